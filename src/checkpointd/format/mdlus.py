"""PhysicsNeMo ``.mdlus`` model files, written and read without importing PhysicsNeMo.

A ``.mdlus`` file (PhysicsNeMo >= 2.0) is an uncompressed zip with exactly three members at its root:
``args.json`` (how to rebuild the module), ``metadata.json`` (format versions) and ``model.pt`` (the
``torch.save`` of its state dict). Before 2.0 the same members sat in a plain tar, and PhysicsNeMo's
reader still tries tar first, then zip; this module reads both in that order.

Why a module of our own rather than ``Module.save``: PhysicsNeMo builds the whole ``model.pt`` in a
``BytesIO`` and then copies it into a temporary zip, so tensor bytes are copied twice and nothing can
stream through our codec and checksum. Here the zip is streamed into any sink (a codec, a checksum
stream, a file) with data descriptors, never seeking, and ``model.pt`` is the output of
:func:`checkpointd.format.serialize.write_pt` passed straight into the zip member, so tensor bytes are never
copied into Python ``bytes``.

PhysicsNeMo is never imported: its modules are recognised by duck typing (an ``_args`` dict and a
``__model_checkpoint_version__`` attribute), and its version is read from installed package metadata.
Limits: ``args.json`` can only hold what ``json.dumps`` accepts, exactly as in PhysicsNeMo.
"""

from __future__ import annotations

import functools
import importlib.metadata
import io
import json
import pickle
import pickletools
import re
import tarfile
import zipfile
from typing import IO, Any, BinaryIO, cast

import torch

from checkpointd.errors import CheckpointError, CorruptCheckpointError, StateError, UnsafeCheckpointError
from checkpointd.format.serialize import PtPlan, Sink, write_pt
from checkpointd.format.streams import ReadStream, WriteOnlyStream

ARGS_MEMBER = "args.json"
METADATA_MEMBER = "metadata.json"
MODEL_MEMBER = "model.pt"
MEMBER_NAMES = (ARGS_MEMBER, METADATA_MEMBER, MODEL_MEMBER)
"""The three members of a ``.mdlus`` file, in the order :func:`write_mdlus` writes them."""

NESTED_MODULE_PREFIX = "__physicsnemo.Module__"
"""PhysicsNeMo's placeholder prefix for a module passed as an ``__init__`` argument of another."""

PHYSICSNEMO_DISTRIBUTION = "nvidia-physicsnemo"
FALLBACK_PHYSICSNEMO_VERSION = "2.2.2"
"""Written as ``physicsnemo_version`` when PhysicsNeMo is not installed: the release we test against."""

_ARGS_KEYS = ("__name__", "__module__", "__args__")
_FORMAT_GLOBAL_PREFIXES = ("torch.", "collections.OrderedDict")
"""Globals that ``torch.save`` files reference themselves; left out when naming what was refused."""
_ZIP_DATE = (1980, 1, 1, 0, 0, 0)
"""Fixed member timestamp, so the same state always gives the same bytes."""


# --- recognising PhysicsNeMo modules ---------------------------------------------------------------


def unwrap_module(module: Any) -> Any:
    """The user's module inside ``DistributedDataParallel``/``DataParallel`` and ``torch.compile``.

    Wrappers are peeled by type (DDP) or by the ``_orig_mod`` submodule that ``torch.compile`` adds, so a
    user module that merely has a child called ``module`` is left alone.
    """
    while True:
        if isinstance(module, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            module = module.module
        elif isinstance(getattr(module, "_orig_mod", None), torch.nn.Module):
            module = module._orig_mod
        else:
            return module


def is_physicsnemo_module(module: Any) -> bool:
    """True for a ``physicsnemo.core.Module`` instance (wrappers peeled), judged by duck typing.

    PhysicsNeMo's ``Module.__new__`` records every ``__init__`` argument in ``_args``; together with the
    class attribute ``__model_checkpoint_version__`` that is all ``Module.from_checkpoint`` needs.
    """
    module = unwrap_module(module)
    args = getattr(module, "_args", None)
    return (
        isinstance(args, dict)
        and all(key in args for key in _ARGS_KEYS)
        and isinstance(args["__name__"], str)
        and isinstance(args["__module__"], str)
        and isinstance(args["__args__"], dict)
        and hasattr(module, "__model_checkpoint_version__")
    )


# --- args.json and metadata.json -------------------------------------------------------------------


def mdlus_json_members(module: Any) -> dict[str, bytes]:
    """``{"args.json": ..., "metadata.json": ...}`` byte for byte as PhysicsNeMo's ``Module.save`` writes.

    Nested PhysicsNeMo modules among the ``__init__`` arguments become ``"__physicsnemo.Module__.<arg>"``
    placeholders with their own top-level entry in ``args.json`` and a ``"<prefix>.mdlus_file_version"``
    key in ``metadata.json``, depth first, as in ``Module.save``.

    Raises:
        StateError: ``module`` is not a PhysicsNeMo module, an argument is a plain ``torch.nn.Module``
            (PhysicsNeMo cannot rebuild it either), or an argument is not JSON-serializable.
    """
    module = unwrap_module(module)
    if not is_physicsnemo_module(module):
        raise StateError(
            f"{type(module).__name__} is not a PhysicsNeMo module (no _args / __model_checkpoint_version__); "
            "save it as a .pt file instead"
        )
    args = dict(module._args)
    metadata: dict[str, Any] = {
        "physicsnemo_version": physicsnemo_version(),
        "mdlus_file_version": module.__model_checkpoint_version__,
    }
    args["__args__"] = _flatten_nested_args(module, args, metadata, prefix="")
    return {ARGS_MEMBER: _dumps(args, module, ARGS_MEMBER), METADATA_MEMBER: _dumps(metadata, module, METADATA_MEMBER)}


def _flatten_nested_args(module: Any, args: dict[str, Any], metadata: dict[str, Any], prefix: str) -> dict[str, Any]:
    """``module``'s ``__args__`` with nested modules replaced by placeholders; fills ``args``/``metadata``.

    Mirrors PhysicsNeMo's ``Module.save._save_process``: each child's entry is inserted before its own
    children are visited, which fixes the key order of the JSON.
    """
    init_args = dict(module._args["__args__"])
    for name, value in init_args.items():
        if is_physicsnemo_module(value):
            child = unwrap_module(value)
            child_prefix = f"{prefix or NESTED_MODULE_PREFIX}.{name}"
            args[child_prefix] = dict(child._args)
            init_args[name] = child_prefix
            metadata[f"{child_prefix}.mdlus_file_version"] = child.__model_checkpoint_version__
            args[child_prefix]["__args__"] = _flatten_nested_args(child, args, metadata, child_prefix)
        elif isinstance(value, torch.nn.Module):
            raise StateError(
                f"argument {name!r} of {type(module).__name__} is a plain torch.nn.Module, which .mdlus cannot "
                "rebuild; convert its class with physicsnemo.core.Module.from_torch"
            )
    return init_args


def _dumps(obj: dict[str, Any], module: Any, member: str) -> bytes:
    """JSON with ``json.dumps`` defaults, like PhysicsNeMo (so ``Infinity``/``NaN`` tokens may appear)."""
    try:
        return json.dumps(obj).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise StateError(
            f"{member} of {type(module).__name__} is not JSON-serializable ({exc}); PhysicsNeMo modules need "
            "JSON-serializable __init__ arguments"
        ) from exc


@functools.lru_cache(maxsize=1)
def physicsnemo_version() -> str:
    """The installed PhysicsNeMo's version (from package metadata, without importing it), else a constant."""
    try:
        return importlib.metadata.version(PHYSICSNEMO_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return FALLBACK_PHYSICSNEMO_VERSION


# --- writing -----------------------------------------------------------------------------------------


def write_mdlus(
    sink: Sink, json_members: dict[str, bytes], model_plan: PtPlan, dtypes: dict[str, torch.dtype] | None = None,
    records: Any = None,
) -> None:
    """Stream a ``.mdlus`` file into ``sink``: a STORED zip of ``args.json``, ``metadata.json``, ``model.pt``.

    The sink is only ever written to, never sought (members end with data descriptors). ``model.pt`` is
    produced by :func:`~checkpointd.format.serialize.write_pt` directly into the zip member, so tensor bytes
    pass through as memoryviews. If ``sink`` has a ``dtype_hint`` attribute, it is set while each tensor's
    bytes pass, exactly as when ``write_pt`` writes to ``sink`` itself.

    Args:
        sink: anything with ``write(memoryview)``; runs on the caller's thread (a writer thread).
        json_members: from :func:`mdlus_json_members`.
        model_plan: ``plan_pt`` of the module's flat state dict.
        dtypes: element dtype per record key of ``model_plan`` (forwarded to ``write_pt``).
        records: host budget: where placeholder records' bytes come from (forwarded to ``write_pt``).
    """
    missing = {ARGS_MEMBER, METADATA_MEMBER} - json_members.keys()
    if missing:
        raise ValueError(f"write_mdlus: json_members lacks {sorted(missing)}; build it with mdlus_json_members()")
    with zipfile.ZipFile(WriteOnlyStream(sink), "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name in (ARGS_MEMBER, METADATA_MEMBER):
            zf.writestr(zipfile.ZipInfo(name, date_time=_ZIP_DATE), json_members[name])
        info = zipfile.ZipInfo(MODEL_MEMBER, date_time=_ZIP_DATE)
        with zf.open(info, "w", force_zip64=_needs_zip64(model_plan)) as member:
            write_pt(model_plan, _member_writer(member, sink), dtypes, records=records)


def _needs_zip64(plan: PtPlan) -> bool:
    """Whether ``model.pt`` may exceed the plain-zip size limit (its size is unknown until written).

    Zip64 records are written only when needed, like PhysicsNeMo's own files (whose sizes zipfile knows).
    The margin covers ``write_pt``'s headers: well under 512 bytes per record plus the small members.
    """
    upper_bound = len(plan.pickle_bytes) + plan.data_nbytes + 512 * (len(plan.storages) + 8)
    return upper_bound > zipfile.ZIP64_LIMIT


class _MemberWriter:
    """The sink ``write_pt`` writes ``model.pt`` into: the open zip member."""

    def __init__(self, member: IO[bytes], outer: Sink) -> None:
        self._member = member
        self._outer = outer

    def write(self, data: Any, /) -> int:
        return self._member.write(data)


class _HintedMemberWriter(_MemberWriter):
    """A member writer that forwards ``dtype_hint`` to the outer sink, which sees the tensor bytes."""

    @property
    def dtype_hint(self) -> torch.dtype | None:
        return self._outer.dtype_hint  # type: ignore[attr-defined, no-any-return]

    @dtype_hint.setter
    def dtype_hint(self, value: torch.dtype | None) -> None:
        self._outer.dtype_hint = value  # type: ignore[attr-defined]


def _member_writer(member: IO[bytes], outer: Sink) -> _MemberWriter:
    # write_pt sets dtype_hint only on sinks that have it, so the attribute must exist only then.
    return _HintedMemberWriter(member, outer) if hasattr(outer, "dtype_hint") else _MemberWriter(member, outer)


# --- reading -----------------------------------------------------------------------------------------


def open_mdlus_model_pt(raw: ReadStream | bytes) -> BinaryIO:
    """A readable, seekable stream of the ``model.pt`` member of a ``.mdlus`` file.

    Tries tar first, then zip, like PhysicsNeMo: a pre-2.0 tar is often also a valid zip. A stored zip
    member is returned as a lazy stream over ``raw`` (so a caller can read one tensor without the rest);
    a compressed member is read into memory, since ``torch.load`` seeks a lot.

    Raises:
        CorruptCheckpointError: ``raw`` is neither a tar nor a zip, or holds no ``model.pt``.
    """
    return _open_member(_seekable(raw), MODEL_MEMBER)


def read_mdlus_json(raw: ReadStream | bytes) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(args, metadata)`` of a ``.mdlus`` file, parsed like PhysicsNeMo (``Infinity``/``NaN`` allowed).

    Raises:
        CorruptCheckpointError: a member is missing or is not a JSON object.
    """
    stream = _seekable(raw)
    args = _load_json(stream, ARGS_MEMBER)
    metadata = _load_json(stream, METADATA_MEMBER)
    return args, metadata


def load_mdlus_state_dict(raw: ReadStream | bytes) -> dict[str, Any]:
    """The model state dict of a ``.mdlus`` file, on the CPU, loaded without running any code.

    ``model.pt`` goes through ``torch.load(weights_only=True)``, whose unpickler only builds tensors and
    plain containers; a pickle that references anything else is refused before it runs.

    Raises:
        UnsafeCheckpointError: ``model.pt``'s pickle references code outside torch's safe allow-list.
        CorruptCheckpointError: the file or its ``model.pt`` cannot be read.
    """
    stream = open_mdlus_model_pt(raw)
    try:
        state = torch.load(stream, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise _refusal_error(stream, str(exc)) from None
    except Exception as exc:
        raise CorruptCheckpointError(f"model.pt of the .mdlus file cannot be loaded: {exc}") from exc
    if not isinstance(state, dict):
        raise CorruptCheckpointError(f"model.pt of the .mdlus file holds a {type(state).__name__}, not a state dict")
    return state


def _refusal_error(model_pt: BinaryIO, torch_message: str) -> CheckpointError:
    """Why torch's weights-only unpickler refused ``model.pt``: an unsafe pickle, or no pickle at all.

    A well-formed pickle that the safe loader refuses asks for something beyond tensors and containers,
    which a checkpoint never needs: that is an unsafe file. Garbage that does not even parse is corrupt.
    The pickle is only parsed (``pickletools``), never run.
    """
    try:
        names = pickle_globals(_pickle_bytes(model_pt))
    except (ValueError, EOFError, zipfile.BadZipFile) as exc:
        return CorruptCheckpointError(f"model.pt of the .mdlus file is not a valid torch.save file: {exc}")
    found = re.search(r"GLOBAL (\S+)", torch_message)
    suspects = [name for name in names if not name.startswith(_FORMAT_GLOBAL_PREFIXES)]
    refused = found.group(1) if found else ", ".join(suspects)
    what = f"references {refused}" if refused else "uses pickle instructions"
    return UnsafeCheckpointError(
        f"model.pt of the .mdlus file {what}, which is outside the safe allow-list for "
        "checkpoints; it was refused before anything ran. Do not load this file unless you trust its source."
    )


def _pickle_bytes(model_pt: BinaryIO) -> bytes:
    """The ``data.pkl`` record of a ``torch.save`` zip, or the raw bytes of a pre-zip ``torch.save`` file (not a zip)."""
    model_pt.seek(0)
    if not zipfile.is_zipfile(model_pt):
        model_pt.seek(0)
        return model_pt.read()
    with zipfile.ZipFile(model_pt) as zf:
        name = next((n for n in zf.namelist() if n.endswith("data.pkl")), None)
        if name is None:
            raise ValueError("it has no data.pkl record")
        return zf.read(name)


def pickle_globals(data: bytes) -> list[str]:
    """Names of the globals a pickle references (``module.name``), parsed with ``pickletools``, never run."""
    names: list[str] = []
    strings: list[str] = []
    for opcode, arg, _ in pickletools.genops(data):
        if opcode.name in ("GLOBAL", "INST"):
            names.append(".".join(str(arg).split(" ", 1)))
        elif opcode.name == "STACK_GLOBAL" and len(strings) >= 2:
            names.append(".".join(strings[-2:]))
        elif isinstance(arg, str):
            strings.append(arg)
    return names


def _seekable(raw: ReadStream | bytes) -> ReadStream:
    """``raw`` as a seekable stream (bytes and unseekable streams are read into memory)."""
    if isinstance(raw, (bytes, bytearray, memoryview)):
        return io.BytesIO(raw)
    if not raw.seekable():
        return io.BytesIO(raw.read())
    return raw


def _load_json(stream: ReadStream, name: str) -> dict[str, Any]:
    text = _open_member(stream, name).read()
    try:
        value = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptCheckpointError(f"{name} of the .mdlus file is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise CorruptCheckpointError(f"{name} of the .mdlus file holds a {type(value).__name__}, not an object")
    return value


def _open_member(stream: ReadStream, name: str) -> BinaryIO:
    """Member ``name`` of a tar (tried first) or zip archive, as a readable stream."""
    member = _open_tar_member(stream, name)
    if member is None:
        member = _open_zip_member(stream, name)
    if member is None:
        raise CorruptCheckpointError(
            f"not a valid .mdlus file: it is neither a tar nor a zip holding {name!r} "
            "(truncated or overwritten?); restore from an older checkpoint"
        )
    return member


def _open_tar_member(stream: ReadStream, name: str) -> BinaryIO | None:
    stream.seek(0)
    try:
        tar = tarfile.open(fileobj=cast(IO[bytes], stream), mode="r:*")  # the stub asks for write() even to read
        info = next((m for m in tar.getmembers() if _member_name(m.name) == name and m.isfile()), None)
        return tar.extractfile(info) if info is not None else None  # type: ignore[return-value]
    except (tarfile.TarError, EOFError, OSError):
        return None


def _open_zip_member(stream: ReadStream, name: str) -> BinaryIO | None:
    stream.seek(0)
    try:
        zf = zipfile.ZipFile(stream)
    except (zipfile.BadZipFile, EOFError, OSError):
        return None
    info = next((i for i in zf.infolist() if _member_name(i.filename) == name and not i.is_dir()), None)
    if info is None:
        return None
    try:
        if info.compress_type == zipfile.ZIP_STORED:
            return zf.open(info)  # type: ignore[return-value]
        return io.BytesIO(zf.read(info))
    except (zipfile.BadZipFile, NotImplementedError, OSError, EOFError) as exc:
        raise CorruptCheckpointError(f"{name} in the .mdlus file cannot be read: {exc}") from exc


def _member_name(path: str) -> str:
    """Archive member name without a leading ``./`` (some tar writers add it)."""
    return path[2:] if path.startswith("./") else path


__all__ = [
    "MEMBER_NAMES",
    "is_physicsnemo_module",
    "load_mdlus_state_dict",
    "mdlus_json_members",
    "open_mdlus_model_pt",
    "pickle_globals",
    "read_mdlus_json",
    "unwrap_module",
    "write_mdlus",
]
