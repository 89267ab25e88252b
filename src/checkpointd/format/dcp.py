"""PyTorch Distributed Checkpoint (DCP) directories, read without running code from them.

A DCP directory (``torch.distributed.checkpoint.save``, TorchTitan) holds ``.metadata``, a pickle of
``torch.distributed.checkpoint.metadata.Metadata``, and ``*.distcp`` data files in which every item is
one ``torch.save`` blob at an offset the metadata gives. PyTorch's own reader unpickles ``.metadata``
with plain ``pickle.load`` and non-tensor items with ``torch.load(weights_only=False)``: both run any
code a crafted file names. This reader does neither:

- ``.metadata`` is read by :class:`MetadataUnpickler`, which resolves only the DCP metadata classes
  and the torch and builtin names they pickle (dtypes, ``torch.Size``, layouts, paths), each to an
  inert stand-in defined here (``torch.distributed.checkpoint`` is not even imported), and applies
  pickle state only to those stand-ins. Any other global raises :class:`UnsafeCheckpointError`.
- The metadata is then checked as untrusted input: every data file is a relative path inside the
  directory (no ``..``, no absolute path, no backslash; links are the caller's store's business), every
  item lies inside its file and items of one file do not overlap, chunks lie inside their tensor and
  cover it exactly, so nothing is allocated beyond what the files hold.
- Every item, tensor or not, is loaded with ``torch.load(weights_only=True)``.

The result is what DCP's own ``_EmptyStateDictLoadPlanner`` rebuilds: nested dicts and lists keyed as
DCP flattened them (dict keys become strings: an optimizer's ``state`` comes back keyed ``"0"``,
``"1"``...), every tensor whole, contiguous and on the CPU. Items written through a DCP stream
transform extension (e.g. its experimental compression) are refused with a clear error, and so are
per-rank ``__<rank>.metadata`` files (only ``.metadata`` is read).
"""

from __future__ import annotations

import io
import math
import pickle
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import PurePosixPath, PureWindowsPath
from typing import IO, Any, Protocol

import torch

from checkpointd.errors import CorruptCheckpointError, ManifestError, UnsafeCheckpointError

__all__ = ["DATA_SUFFIX", "METADATA_NAME", "DcpBytes", "DcpIndex", "DcpSource", "DcpTensor", "ItemLocation",
           "MetadataUnpickler", "is_dcp_dir", "load_dcp", "parse_metadata"]

METADATA_NAME = ".metadata"
"""The file that makes a directory a DCP checkpoint."""
DATA_SUFFIX = ".distcp"
"""The suffix of DCP's data files (``__<rank>_<n>.distcp``)."""


class DcpSource(Protocol):
    """Where a DCP directory is read from: :class:`checkpointd.storage.store.Store` is one."""

    def size(self, rel: str) -> int: ...

    def open_read(self, rel: str) -> IO[bytes]: ...

    def read_bytes(self, rel: str) -> bytes: ...

    def display(self, rel: str = "") -> str: ...


def is_dcp_dir(names: list[str]) -> bool:
    """Whether a directory listing (base names) is a DCP checkpoint's."""
    return METADATA_NAME in names


# -- the restricted unpickler --------------------------------------------------------------------------
class _Record:
    """An inert stand-in for one DCP metadata dataclass: pickle state lands in ``__dict__``, nothing runs."""


class _Metadata(_Record):
    pass


class _TensorStorageMetadata(_Record):
    pass


class _BytesStorageMetadata(_Record):
    pass


class _ChunkStorageMetadata(_Record):
    pass


class _MetadataIndex(_Record):
    pass


class _StorageMeta(_Record):
    pass


class _StorageInfo(_Record):
    pass


class _TensorProperties(_Record):
    def __setstate__(self, state: Any) -> None:
        """DCP pickles ``(dtype, layout, requires_grad, memory format, pin_memory)``; older versions a dict."""
        if isinstance(state, tuple) and state:
            self.dtype = state[0]
        elif isinstance(state, dict):
            self.dtype = state.get("dtype")


def _size(dims: Any = ()) -> tuple[int, ...]:
    """``torch.Size(dims)`` as a plain tuple of ints >= 0."""
    out = tuple(dims)
    if any(type(d) is not int or d < 0 for d in out):
        raise pickle.UnpicklingError(f"a torch.Size holds {out[:8]!r}, not integers >= 0")
    return out


def _scalar(value: Any = None) -> Any:
    """An enum member or layout by value (memory format encoding, ``torch.strided``): kept as the value."""
    if not isinstance(value, (int, str)):
        raise pickle.UnpicklingError(f"an enum or layout value is a {type(value).__name__}")
    return value


def _path(*parts: Any) -> str:
    """``pathlib`` paths (the checkpoint id DCP records) as strings, never touching the filesystem."""
    if not all(isinstance(p, str) for p in parts):
        raise pickle.UnpicklingError("a pickled path holds something other than strings")
    return str(PurePosixPath(*parts)) if all("\\" not in p for p in parts) else str(PureWindowsPath(*parts))


_DCP = "torch.distributed.checkpoint"
_SHARD_MD = "torch.distributed._shard.sharded_tensor.metadata"  # where older PyTorch kept two of them
ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {
    (f"{_DCP}.metadata", "Metadata"): _Metadata,
    (f"{_DCP}.metadata", "TensorStorageMetadata"): _TensorStorageMetadata,
    (f"{_DCP}.metadata", "BytesStorageMetadata"): _BytesStorageMetadata,
    (f"{_DCP}.metadata", "ChunkStorageMetadata"): _ChunkStorageMetadata,
    (f"{_DCP}.metadata", "MetadataIndex"): _MetadataIndex,
    (f"{_DCP}.metadata", "StorageMeta"): _StorageMeta,
    (f"{_DCP}.metadata", "TensorProperties"): _TensorProperties,
    (f"{_DCP}.metadata", "_MEM_FORMAT_ENCODING"): _scalar,
    (_SHARD_MD, "TensorProperties"): _TensorProperties,
    (_SHARD_MD, "MEM_FORMAT_ENCODING"): _scalar,
    (f"{_DCP}.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): _size,
    ("torch.serialization", "_get_layout"): _scalar,
    ("collections", "OrderedDict"): dict,
    **{("pathlib", name): _path for name in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath",
                                              "PureWindowsPath")},
}
"""Every global a DCP ``.metadata`` pickle may name, and the inert object it resolves to. Torch dtypes
(``torch.float32``, ...) resolve to themselves."""


class _Refused(pickle.UnpicklingError):
    """A global outside :data:`ALLOWED_GLOBALS` (turned into UnsafeCheckpointError)."""


class MetadataUnpickler(pickle._Unpickler):  # the pure-Python unpickler: its BUILD step can be restricted
    """Unpickles a DCP ``.metadata`` into inert stand-ins; refuses every other global.

    Why the pure-Python unpickler: pickle's BUILD opcode sets attributes on whatever object is on the
    stack, a class included; only here can it be limited to instances of the stand-in records, so a
    crafted file cannot even change this module's own classes. Metadata files are small (kilobytes to
    a few megabytes), so the slower unpickler costs little.
    """

    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str) -> Any:
        found = ALLOWED_GLOBALS.get((module, name))
        if found is not None:
            return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _Refused(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids do not occur in DCP metadata")

    def load_build(self) -> None:
        if not isinstance(self.stack[-2], _Record):
            raise _Refused(f"pickle state applied to a {type(self.stack[-2]).__name__}")
        pickle._Unpickler.load_build(self)

    dispatch[pickle.BUILD[0]] = load_build


# -- the validated index -------------------------------------------------------------------------------
@dataclass(frozen=True)
class ItemLocation:
    """Where one item's ``torch.save`` blob lies."""

    path: str
    """Relative to the DCP directory."""
    offset: int
    length: int


@dataclass(frozen=True)
class DcpTensor:
    """A tensor: its dtype, global size and the chunks that cover it."""

    dtype: torch.dtype
    size: tuple[int, ...]
    chunks: tuple[tuple[tuple[int, ...], tuple[int, ...], ItemLocation], ...]
    """``(offsets, sizes, location)`` per chunk."""


@dataclass(frozen=True)
class DcpBytes:
    """A non-tensor value (``torch.save`` of any object)."""

    location: ItemLocation


@dataclass(frozen=True)
class DcpIndex:
    """The checked content of a ``.metadata``: items by flattened key, and each key's path in the nested result."""

    items: dict[str, DcpTensor | DcpBytes]
    paths: dict[str, tuple[str | int, ...]]


class _Invalid(Exception):
    """A metadata field of the wrong type or value (turned into ManifestError)."""


def parse_metadata(data: bytes, where: str) -> DcpIndex:
    """Unpickle ``.metadata`` with :class:`MetadataUnpickler` and check it; nothing in it runs.

    Raises:
        UnsafeCheckpointError: the pickle names a global outside :data:`ALLOWED_GLOBALS`.
        ManifestError: not a DCP metadata pickle, or a field of the wrong type or value (a data file
            path that leaves the directory, a chunk outside its tensor, an unsupported stream transform).
    """
    try:
        md = MetadataUnpickler(io.BytesIO(data)).load()
    except _Refused as exc:
        raise UnsafeCheckpointError(
            f"{where} is a pickle that references {exc}, which a DCP metadata file never needs; it was not "
            "run. The file is not a plain DCP checkpoint: load it only if you trust its source, with PyTorch itself"
        ) from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, LookupError, OverflowError,
            RecursionError, MemoryError, UnicodeDecodeError, struct.error) as exc:
        raise ManifestError(f"{where} is not a readable DCP metadata pickle ({type(exc).__name__}: {str(exc)[:200]})") from exc
    try:
        return _index(md)
    except _Invalid as exc:
        raise ManifestError(f"{where}: {exc}; the DCP checkpoint is damaged or was altered") from None


def _attr(obj: Any, name: str, default: Any = None) -> Any:
    return obj.__dict__.get(name, default)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise _Invalid(message)


def _int(value: Any, what: str) -> int:
    _check(type(value) is int and value >= 0, f"{what} is {value!r}, not an integer >= 0")
    return value


def _location(info: Any, key: str) -> ItemLocation:
    _check(type(info) is _StorageInfo, f"the storage record of {key!r} is a {type(info).__name__}")
    path = _attr(info, "relative_path")
    _check(isinstance(path, str) and is_inside(path), f"{key!r} names data file {path!r}, which is not inside the directory")
    transforms = _attr(info, "transform_descriptors")
    _check(not transforms, f"{key!r} was written through DCP stream transforms {transforms!r}, which this reader does not "
                           "apply; load this checkpoint with torch.distributed.checkpoint")
    return ItemLocation(path, _int(_attr(info, "offset"), f"offset of {key!r}"), _int(_attr(info, "length"), f"length of {key!r}"))


def is_inside(path: str) -> bool:
    """Whether ``path`` names a file inside the directory: relative, '/'-separated, no ``.``/``..``/empty
    parts, no backslash or control characters, not the metadata itself."""
    parts = path.split("/")
    return (0 < len(path) <= 1024 and not path.startswith("/") and len(parts) <= 4 and path != METADATA_NAME
            and not any(p in ("", ".", "..") for p in parts) and not any(c == "\\" or ord(c) < 32 or c == "\x7f" for c in path))


def _tensor(key: str, md: Any, locations: dict[tuple[str, Any], ItemLocation]) -> DcpTensor:
    dtype = _attr(_attr(md, "properties"), "dtype") if isinstance(_attr(md, "properties"), _TensorProperties) else None
    _check(isinstance(dtype, torch.dtype), f"tensor {key!r} has no dtype")
    size = _attr(md, "size")
    _check(isinstance(size, tuple) and len(size) <= 64, f"tensor {key!r} has size {size!r}")
    chunks = _attr(md, "chunks")
    _check(isinstance(chunks, list), f"tensor {key!r} has no chunk list")
    out = []
    for c in chunks:
        _check(type(c) is _ChunkStorageMetadata, f"a chunk of tensor {key!r} is a {type(c).__name__}")
        offsets, sizes = _attr(c, "offsets"), _attr(c, "sizes")
        _check(isinstance(offsets, tuple) and isinstance(sizes, tuple) and len(offsets) == len(sizes) == len(size)
               and all(o + s <= d for o, s, d in zip(offsets, sizes, size)),
               f"a chunk of tensor {key!r} (offsets {offsets!r}, sizes {sizes!r}) lies outside its size {size!r}")
        loc = locations.get((key, offsets))
        _check(loc is not None, f"tensor {key!r} has no storage record for its chunk at {offsets!r}")
        out.append((offsets, sizes, loc))
    _check(sum(math.prod(s) for _, s, _ in out) == math.prod(size),
           f"the chunks of tensor {key!r} do not cover its size {size!r} exactly")
    return DcpTensor(dtype, size, tuple(out))


def _path_of(key: str, path: Any, limit: int) -> tuple[str | int, ...]:
    _check(isinstance(path, tuple) and 0 < len(path) <= 64 and isinstance(path[0], str)
           and all(isinstance(p, str) or (type(p) is int and 0 <= p <= limit) for p in path),
           f"the planner path of {key!r} is {str(path)[:200]}")
    return path


def _index(md: Any) -> DcpIndex:
    _check(type(md) is _Metadata, f"the pickle holds a {type(md).__name__}, not DCP Metadata")
    state_md, storage, planner = _attr(md, "state_dict_metadata"), _attr(md, "storage_data"), _attr(md, "planner_data")
    _check(isinstance(state_md, dict) and isinstance(storage, dict), "state_dict_metadata or storage_data is missing")
    _check(planner is None or isinstance(planner, dict), f"planner_data is a {type(planner).__name__}")
    locations: dict[tuple[str, Any], ItemLocation] = {}
    for index, info in storage.items():
        _check(type(index) is _MetadataIndex and isinstance(_attr(index, "fqn"), str), f"a storage key is a {type(index).__name__}")
        offset = _attr(index, "offset")
        _check(offset is None or isinstance(offset, tuple), f"the storage key of {_attr(index, 'fqn')!r} has offset {offset!r}")
        locations[(_attr(index, "fqn"), offset)] = _location(info, _attr(index, "fqn"))
    items: dict[str, DcpTensor | DcpBytes] = {}
    paths: dict[str, tuple[str | int, ...]] = {}
    for key, item in state_md.items():
        _check(isinstance(key, str), f"a key is a {type(key).__name__}, not a string")
        if type(item) is _TensorStorageMetadata:
            items[key] = _tensor(key, item, locations)
        else:
            _check(type(item) is _BytesStorageMetadata, f"{key!r} is a {type(item).__name__}, not tensor or bytes metadata")
            loc = locations.get((key, None))
            _check(loc is not None, f"{key!r} has no storage record")
            items[key] = DcpBytes(loc)
        paths[key] = _path_of(key, planner.get(key, (key,)) if planner else (key,), len(state_md))
    return DcpIndex(items, paths)


# -- reading the data ----------------------------------------------------------------------------------
def load_dcp(source: DcpSource) -> dict[str, Any]:
    """The whole DCP checkpoint in ``source`` as nested plain data with contiguous CPU tensors.

    Raises:
        UnsafeCheckpointError: ``.metadata`` or an item references code outside the allow-lists.
        ManifestError: ``.metadata`` is malformed (see :func:`parse_metadata`).
        CorruptCheckpointError: a data file is missing, truncated, or holds an item that does not
            decode to what the metadata says.
    """
    index = parse_metadata(source.read_bytes(METADATA_NAME), source.display(METADATA_NAME))
    blobs = _check_extents(source, index)
    values: dict[str, Any] = {}
    for path, items in blobs.items():
        where = source.display(path)
        for key, loc, blob in _read_items(source, path, items):
            value = _load_item(blob, f"{where} (item {key!r} at offset {loc.offset})")
            values.setdefault(key, []).append((loc, value))
    flat = {key: _assemble(key, item, dict(values.get(key, []))) for key, item in index.items.items()}
    return _unflatten(flat, index.paths, source.display())


def _check_extents(source: DcpSource, index: DcpIndex) -> dict[str, list[tuple[str, ItemLocation]]]:
    """Every item inside its file, no two items of a file overlapping; ``{file: [(key, location)]}`` by offset."""
    per_file: dict[str, list[tuple[str, ItemLocation]]] = {}
    for key, item in index.items.items():
        locs = [item.location] if isinstance(item, DcpBytes) else [loc for _, _, loc in item.chunks]
        for loc in locs:
            per_file.setdefault(loc.path, []).append((key, loc))
    for path, items in per_file.items():
        where = source.display(path)
        try:
            size = source.size(path)
        except FileNotFoundError as exc:
            raise CorruptCheckpointError(f"{where} is named by {METADATA_NAME} but missing") from exc
        items.sort(key=lambda kl: kl[1].offset)
        end = 0
        for key, loc in items:
            if loc.offset + loc.length > size:
                raise CorruptCheckpointError(f"{where} has {size} bytes, but item {key!r} ends at byte "
                                             f"{loc.offset + loc.length}: the file is truncated")
            if loc.offset < end:
                raise CorruptCheckpointError(f"{where}: item {key!r} overlaps the item before it; the checkpoint is damaged")
            end = loc.offset + loc.length
    return per_file


def _read_items(source: DcpSource, path: str, items: list[tuple[str, ItemLocation]]) -> Iterator[tuple[str, ItemLocation, bytes]]:
    with source.open_read(path) as f:
        for key, loc in items:
            f.seek(loc.offset)
            blob = f.read(loc.length)
            if len(blob) != loc.length:
                raise CorruptCheckpointError(f"{source.display(path)} ended inside item {key!r}: the file is truncated")
            yield key, loc, blob


def _load_item(blob: bytes, where: str) -> Any:
    try:
        return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if not _names_code(str(exc)):  # refused, but for garbage (an unknown opcode), not for code it names
            raise CorruptCheckpointError(f"{where} is not a readable torch.save blob: {str(exc)[-200:]}") from exc
        raise UnsafeCheckpointError(f"{where} holds a pickle that references code outside the weights-only "
                                    f"allow-list; it was not run. Load it only if you trust its source. ({exc})") from exc
    except Exception as exc:  # noqa: BLE001 - any failure to decode a verified-in-place blob is damage
        raise CorruptCheckpointError(f"{where} is not a readable torch.save blob ({type(exc).__name__}: {str(exc)[:200]})") from exc


def _names_code(message: str) -> bool:
    """Whether a weights-only refusal is about a global, call or build outside the allow-list."""
    lowered = message.lower()
    return any(word in lowered for word in ("global", "reduce", "build"))


def _assemble(key: str, item: DcpTensor | DcpBytes, loaded: dict[ItemLocation, Any]) -> Any:
    if isinstance(item, DcpBytes):
        return loaded[item.location]
    parts = []
    for offsets, sizes, loc in item.chunks:
        chunk = loaded[loc]
        if not isinstance(chunk, torch.Tensor) or tuple(chunk.shape) != sizes or chunk.dtype != item.dtype:
            got = f"{chunk.dtype} {tuple(chunk.shape)}" if isinstance(chunk, torch.Tensor) else type(chunk).__name__
            raise CorruptCheckpointError(f"item {key!r} at {loc.path}:{loc.offset} holds {got}, the metadata says "
                                         f"{item.dtype} {sizes}")
        parts.append((offsets, chunk))
    if len(parts) == 1 and parts[0][1].shape == item.size:
        return parts[0][1].contiguous()
    full = torch.zeros(item.size, dtype=item.dtype)
    for offsets, chunk in parts:
        full[tuple(slice(o, o + s) for o, s in zip(offsets, chunk.shape))] = chunk
    return full


def _unflatten(flat: dict[str, Any], paths: dict[str, tuple[str | int, ...]], where: str) -> dict[str, Any]:
    """Nest ``flat`` along each key's planner path, as DCP's ``set_element`` does (an int step is a list index)."""
    root: dict[str, Any] = {}
    for key, value in flat.items():
        path = paths[key]
        node: Any = root
        for step, nxt in zip(path[:-1], path[1:]):
            node = _child(node, step, [] if isinstance(nxt, int) else {}, key, where)
        _child(node, path[-1], value, key, where, leaf=True)
    return root


def _child(node: Any, step: str | int, new: Any, key: str, where: str, leaf: bool = False) -> Any:
    """``node[step]``, set to ``new`` when absent (a list grows to the index, ``None`` in the gaps)."""
    if isinstance(step, int):
        if not isinstance(node, list):
            raise ManifestError(f"{where}: the planner path of {key!r} indexes a {type(node).__name__} with {step}")
        node.extend([None] * (step + 1 - len(node)))
        current = node[step]
    else:
        if not isinstance(node, dict):
            raise ManifestError(f"{where}: the planner path of {key!r} names {step!r} inside a {type(node).__name__}")
        current = node.get(step)
    if current is None:
        node[step] = new
        return new
    if leaf or type(current) is not type(new):
        raise ManifestError(f"{where}: the planner path of {key!r} meets another item's value at {step!r}")
    return current
