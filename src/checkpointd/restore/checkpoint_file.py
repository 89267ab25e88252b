"""One checkpoint file opened for partial reads: its tensors known from the pickle, each read on its own.

How: a ``.pt`` file is ``torch.save``'s zip container. :class:`CheckpointFile` reads the zip's central
directory (at the end of the file) and its ``data.pkl`` record through seeks, unpickles ``data.pkl``
with torch's weights-only unpickler into *meta* tensors (shape, dtype, strides; no data), and then
reads only the records behind the tensors asked for. A compressed file (``.zst``) is read through the
codec's seek table (``Codec.open_decoded``), so only the chunks holding the needed bytes are fetched
and decoded. A ``.mdlus`` file is a zip whose stored ``model.pt`` member is itself such a ``.pt``;
it is read through a window on the outer stream. Any seekable binary file works underneath (local
files, fsspec files with ranged reads on S3/GCS, ``BytesIO``).

The same meta-tensor view serves ``checkpointd inspect``: shapes and dtypes of every tensor of a
file, from its pickle alone.

Integrity: each record read is checked against the CRC-32 of the zip directory and each decoded chunk
against its codec checksum. (A file of a committed step is also streamed through its manifest checksum
before it is opened: :mod:`checkpointd.restore.partial`.)

Safety: ``data.pkl`` only ever goes through torch's weights-only unpickler; a pickle that references
anything outside its allow-list raises :class:`UnsafeCheckpointError` before anything runs.

Limits: one ``CheckpointFile`` is for one thread at a time. Files written in the other byte order,
and tensor types not rebuilt from plain storages (sparse, quantized, nested), are refused with a
message pointing to :func:`checkpointd.load`.
"""

from __future__ import annotations

import io
import pickle
import struct
import sys
import zipfile
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import _weights_only_unpickler

from checkpointd.codecs.compress import get_codec
from checkpointd.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, UnsafeCheckpointError
from checkpointd.format.mdlus import MODEL_MEMBER, open_mdlus_model_pt, pickle_globals
from checkpointd.format.streams import ReadStream, SeekableReader

__all__ = ["CheckpointFile", "KeyPath", "TensorInfo", "iter_tensors", "join_key", "lookup", "split_key",
           "unsafe_or_corrupt"]

KeyPath = str | Sequence[Any]
"""A tensor's address: ``"optimizer_state_dict/state/0/exp_avg"`` or the same as a sequence of parts."""

_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, ..., file name length, extra field length


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a file, known from the pickle alone."""

    key: str
    """'/'-joined path inside the file's object tree."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    """Bytes of the tensor's own elements (its storage may be larger)."""
    record: str | None
    """Zip record (``data/<record>``) holding its storage."""


class CheckpointFile:
    """One native ``.pt``/``.mdlus`` file, optionally compressed, opened for partial reads.

    Args:
        raw: a seekable binary stream of the file *as stored* (closed by :meth:`close`).
        codec: the codec the file was stored with (``"none"``, ``"zstd"``, ...).
        fmt: ``"pt"`` or ``"mdlus"``.
        where: how to name the file in error messages.

    Raises:
        CorruptCheckpointError: not a zip-format ``.pt``/``.mdlus`` (or a damaged one).
    """

    def __init__(self, raw: ReadStream, *, codec: str = "none", fmt: str = "pt", where: str = "checkpoint file") -> None:
        self.where = where
        self._raw = raw
        self._streams: list[Any] = [raw]
        stream: ReadStream = raw
        if codec not in ("none", "", None):
            stream = get_codec(codec).open_decoded(raw)
            self._streams.append(stream)
        if fmt == "mdlus":
            stream = self._model_pt_of_mdlus(stream)
        self._zip = _open_zip(stream, where)
        self._prefix = _archive_prefix(self._zip, where)
        self._structure: Any = None
        self._record_of: dict[int, str] = {}
        self._keepalive: list[Any] = []
        self._storages: dict[str, torch.UntypedStorage] = {}

    # -- structure (pickle only) ----------------------------------------------------------------
    def structure(self) -> Any:
        """The file's object tree with every tensor on the ``meta`` device (no tensor data read).

        Raises:
            UnsafeCheckpointError: the pickle references code outside the weights-only allow-list.
            CorruptCheckpointError: the pickle or the zip is damaged.
        """
        if self._structure is None:
            self._check_byteorder()
            data = self._read_record("data.pkl")
            self._structure = self._unpickle_meta(data)
        return self._structure

    def tensors(self) -> list[TensorInfo]:
        """Every tensor of the file, in pickle order, from the pickle alone."""
        out = []
        for key, t in iter_tensors(self.structure()):
            record = self._record_of.get(_storage_id(t))
            out.append(TensorInfo(key=key, shape=tuple(t.shape), dtype=t.dtype, nbytes=t.numel() * t.element_size(), record=record))
        return out

    # -- data ---------------------------------------------------------------------------------------
    def load_tensor(self, key: KeyPath) -> torch.Tensor:
        """One tensor on the CPU, reading only the record that holds it.

        Raises:
            KeyError (as CheckpointNotFoundError): no tensor at ``key``; the message lists what exists.
        """
        value = lookup(self.structure(), split_key(key), self.where)
        if not isinstance(value, torch.Tensor):
            raise CheckpointNotFoundError(f"{self.where}: {join_key(split_key(key))!r} is a {type(value).__name__}, not a tensor")
        return self._materialize(value)

    def load(self, key: KeyPath = ()) -> Any:
        """The subtree at ``key`` (the whole file by default) with every tensor in it read."""
        return self._materialize_tree(lookup(self.structure(), split_key(key), self.where))

    def close(self) -> None:
        self._storages.clear()
        for s in reversed(self._streams):
            try:
                s.close()
            except Exception:  # noqa: BLE001 - closing a read stream never loses data
                pass

    def __enter__(self) -> CheckpointFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------------------
    def _model_pt_of_mdlus(self, stream: ReadStream) -> ReadStream:
        """``model.pt`` of a ``.mdlus``: a window on the outer stream when the member is stored (the
        format's norm), else whatever PhysicsNeMo's reading order (tar, then zip) gives."""
        try:
            outer = zipfile.ZipFile(stream)
            info = next((i for i in outer.infolist() if i.filename.lstrip("./") == MODEL_MEMBER), None)
        except (zipfile.BadZipFile, OSError, EOFError):
            info = None
        if info is not None and info.compress_type == zipfile.ZIP_STORED and not _looks_like_tar(stream):
            stream.seek(info.header_offset)
            sig, name_len, extra_len = _LOCAL_HEADER.unpack(_read_exact(stream, _LOCAL_HEADER.size, self.where))
            if sig != b"PK\x03\x04":
                raise CorruptCheckpointError(f"{self.where}: bad zip local header for {MODEL_MEMBER}")
            start = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
            return _Window(stream, start, info.file_size)
        stream.seek(0)
        return open_mdlus_model_pt(stream)

    def _read_record(self, name: str) -> bytes:
        try:
            with self._zip.open(self._prefix + name) as member:
                return member.read()
        except KeyError as exc:
            raise CorruptCheckpointError(f"{self.where} has no {name} record; it is not a torch.save file") from exc
        except (zipfile.BadZipFile, EOFError, OSError, struct.error) as exc:
            raise CorruptCheckpointError(f"{self.where}: record {name} is damaged ({exc})") from exc

    def _check_byteorder(self) -> None:
        if self._prefix + "byteorder" not in self._zip.NameToInfo:
            return
        order = self._read_record("byteorder").decode("ascii", "replace").strip()
        if order != sys.byteorder:
            raise CheckpointError(
                f"{self.where} was written on a {order}-endian machine; partial reads do not byte-swap, "
                "use checkpointd.load() for it"
            )

    def _unpickle_meta(self, data: bytes) -> Any:
        def persistent_load(pid: Any) -> Any:
            if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
                raise pickle.UnpicklingError(f"unexpected persistent id {pid!r}")
            _, storage_type, key, _location, numel = pid
            dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
            meta = torch.UntypedStorage(int(numel) * torch._utils._element_size(dtype), device="meta")
            self._keepalive.append(meta)  # keeps _cdata unique while the structure lives
            self._record_of[meta._cdata] = str(key)
            return torch.storage.TypedStorage(wrap_storage=meta, dtype=dtype, _internal=True)

        unpickler = _weights_only_unpickler.Unpickler(io.BytesIO(data), encoding="utf-8")
        unpickler.persistent_load = persistent_load  # type: ignore[method-assign]  # torch types the hook as a method
        try:
            return unpickler.load()
        except pickle.UnpicklingError as exc:
            raise unsafe_or_corrupt(data, self.where, str(exc)) from None
        except (EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError, RuntimeError) as exc:
            raise CorruptCheckpointError(f"{self.where}: data.pkl cannot be read ({type(exc).__name__}: {exc})") from exc

    def _materialize(self, meta: torch.Tensor) -> torch.Tensor:
        record = self._record_of.get(_storage_id(meta))
        if record is None or meta.layout != torch.strided or meta.is_quantized:
            raise CheckpointError(
                f"{self.where}: a {meta.layout} {meta.dtype} tensor cannot be read partially; use checkpointd.load()"
            )
        storage = self._storages.get(record)
        if storage is None:
            data = self._read_record(f"data/{record}")
            expected = meta.untyped_storage().nbytes()
            if len(data) != expected:
                raise CorruptCheckpointError(f"{self.where}: record data/{record} has {len(data)} bytes, the pickle says {expected}")
            storage = torch.UntypedStorage.from_buffer(data, dtype=torch.uint8) if data else torch.UntypedStorage(0)
            self._storages[record] = storage
        out = torch.empty(0, dtype=meta.dtype).set_(storage, meta.storage_offset(), meta.shape, meta.stride())
        if isinstance(meta, torch.nn.Parameter):
            return torch.nn.Parameter(out, requires_grad=meta.requires_grad)
        return out

    def _materialize_tree(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._materialize(obj)
        if isinstance(obj, dict):
            out = type(obj)() if type(obj) in (dict,) or _is_ordered_dict(obj) else {}
            for k, v in obj.items():
                out[k] = self._materialize_tree(v)
            if hasattr(obj, "_metadata"):
                out._metadata = obj._metadata  # type: ignore[attr-defined]
            return out
        if isinstance(obj, list):
            return [self._materialize_tree(v) for v in obj]
        if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            return tuple(self._materialize_tree(v) for v in obj)
        return obj



# -- keys ---------------------------------------------------------------------------------------------
def split_key(key: KeyPath) -> list[Any]:
    if isinstance(key, str):
        return [k for k in key.split("/") if k != ""]
    return list(key)


def join_key(parts: Sequence[Any]) -> str:
    return "/".join(str(p) for p in parts)


def lookup(obj: Any, parts: Sequence[Any], where: str) -> Any:
    """The value at ``parts`` in a tree of dicts/lists; dict keys also match by ``str(key)``."""
    for depth, part in enumerate(parts):
        if isinstance(obj, Mapping):
            if part in obj:
                obj = obj[part]
                continue
            match = [k for k in obj if str(k) == str(part)]
            if match:
                obj = obj[match[0]]
                continue
            options = [str(k) for k in list(obj)[:20]]
        elif isinstance(obj, (list, tuple)) and str(part).lstrip("-").isdigit() and -len(obj) <= int(part) < len(obj):
            obj = obj[int(part)]
            continue
        else:
            options = [str(i) for i in range(len(obj))][:20] if isinstance(obj, (list, tuple)) else []
        at = join_key(parts[:depth]) or "the top level"
        raise CheckpointNotFoundError(f"{where}: no key {str(part)!r} under {at}; it holds {options}")
    return obj


def iter_tensors(obj: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """``(key path, tensor)`` for every tensor in a tree of dicts, lists and tuples."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from iter_tensors(v, f"{prefix}/{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from iter_tensors(v, f"{prefix}/{i}" if prefix else str(i))


def unsafe_or_corrupt(data: bytes, where: str, message: str) -> CheckpointError:
    """Why the weights-only unpickler refused ``data``: code it would run, or no valid pickle at all.

    The pickle is only parsed (``pickletools``), never run.
    """
    try:
        names = pickle_globals(data)
    except Exception as exc:  # noqa: BLE001 - anything pickletools rejects is not a valid pickle
        return CorruptCheckpointError(f"{where}: data.pkl is not a valid pickle ({exc}); the file is damaged")
    suspects = [n for n in names if not n.startswith(("torch.", "collections.OrderedDict", "builtins.set"))]
    what = f"references {', '.join(dict.fromkeys(suspects))}" if suspects else f"was refused ({message})"
    return UnsafeCheckpointError(
        f"{where}: its pickle {what}, outside the weights-only allow-list; it was refused and nothing ran. "
        "Do not load this file unless you trust its source."
    )



# -- helpers ------------------------------------------------------------------------------------------
def _storage_id(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return -1


def _is_ordered_dict(obj: Any) -> bool:
    return type(obj) is OrderedDict


def _open_zip(stream: ReadStream, where: str) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(stream)
    except (zipfile.BadZipFile, EOFError, OSError, struct.error) as exc:
        raise CorruptCheckpointError(
            f"{where} is not a zip-format torch.save file ({exc}): truncated, damaged, or a legacy .pt; "
            "checkpointd.load() reads legacy files"
        ) from exc


def _archive_prefix(zf: zipfile.ZipFile, where: str) -> str:
    for name in zf.namelist():
        if name.endswith("data.pkl") and name.count("/") <= 1:
            return name[: -len("data.pkl")]
    raise CorruptCheckpointError(f"{where} has no data.pkl record; it is not a torch.save file")


def _looks_like_tar(stream: ReadStream) -> bool:
    """A tar that is also a zip: PhysicsNeMo reads it as tar first, so must we."""
    stream.seek(257)
    magic = stream.read(5)
    return magic == b"ustar"


def _read_exact(stream: ReadStream, n: int, where: str) -> bytes:
    data = stream.read(n)
    if data is None or len(data) != n:
        raise CorruptCheckpointError(f"{where}: unexpected end of file")
    return data


class _Window(SeekableReader):
    """Read-only, seekable view of bytes ``[start, start + length)`` of a seekable stream."""

    def __init__(self, raw: ReadStream, start: int, length: int) -> None:
        super().__init__()
        self._raw, self._start, self._length, self._pos = raw, start, length, 0

    def extent(self) -> int:
        return self._length

    def readinto(self, buffer: Any) -> int:
        dest = memoryview(buffer).cast("B")
        n = max(0, min(dest.nbytes, self._length - self._pos))
        if n == 0:
            return 0
        self._raw.seek(self._start + self._pos)
        data = self._raw.read(n)
        dest[: len(data)] = data
        self._pos += len(data)
        return len(data)
