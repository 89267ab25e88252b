"""Serialize: a state tree -> a ``.pt`` file that ``torch.load(weights_only=True)`` reads.

Why not ``torch.save``: it runs single-threaded under the GIL on the training process, writes a view's
whole storage, and cannot stream a record through our codec and checksum without copying it into a
Python ``bytes``. This module produces the same zip container (``data.pkl``, ``byteorder``,
``data/<key>``, ``version``) in two steps:

1. :func:`plan_pt` pickles the object tree (small; tensors become persistent references, exactly as
   ``torch.save`` does), so every record and its size is known before any byte is written;
2. :func:`write_pt` streams the records into a sink, passing tensor bytes as zero-copy memoryviews
   together with their dtype, so a codec can pick a float-aware transform per tensor.

The pickle only references what PyTorch's weights-only unpickler allows (``_rebuild_tensor_v2``,
storage types, plain containers), so the files load safely everywhere.
"""

from __future__ import annotations

import io
import pickle
import sys
import weakref
import zipfile
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch

from checkpointd.format.streams import WriteOnlyStream, byte_view

ARCHIVE_DIR = "archive"
"""Top-level folder inside the zip; ``torch.load`` accepts any single name."""


class Sink(Protocol):
    """Where a serialized file goes: a codec/checksum stream or a plain file."""

    def write(self, data: Any, /) -> int: ...


@dataclass
class PtPlan:
    """Everything needed to write one ``.pt`` file; cheap to build, holds no copy of tensor bytes."""

    pickle_bytes: bytes
    storages: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    """(record key, tensor whose storage is the record) in record order."""
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    """Element dtype of each record, as the pickle's tensors view it (a codec's float-aware choice)."""
    views: dict[str, memoryview] = field(default_factory=dict)
    """Byte views of CPU records kept by a :class:`ReductionCache` (others are made when written)."""

    @property
    def data_nbytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for _, t in self.storages)


class _StorageRef:
    """Stands for one storage record inside the pickle (turned into a persistent id)."""

    __slots__ = ("pid",)

    def __init__(self, pid: tuple[Any, ...]) -> None:
        self.pid = pid


_NOT_STORAGES = frozenset({str, int, float, bool, type(None), tuple, list, dict, OrderedDict, torch.dtype, torch.Size})
_V3_DTYPES = frozenset(torch.storage._new_dtypes())
_STORAGE_TYPE_NAMES = torch.storage._dtype_to_storage_type_map()


class ReductionCache:
    """The pickle reduction of each staging tensor, kept from one save to the next.

    Why: a save pickles the same staging buffers every time (their layout never changes), and building
    a tensor's reduction (its storage, offset, size, stride, the record holder) is most of the Python
    that pickling holds the GIL for: ~20 us a tensor, which a launch-bound training loop feels on the
    step after each save. The record's byte view, which the file layout reads next, is kept with it. A
    hit costs a dictionary lookup and a few attribute reads. Entries are keyed
    by the tensor's identity (a weak reference, so a freed arena leaves nothing alive) and checked
    against its data pointer and shape before use.
    """

    def __init__(self) -> None:
        self._entries: dict[int, _CachedReduction] = {}
        self.hits = 0
        self.misses = 0

    def get(self, t: torch.Tensor, devices: tuple[str, ...]) -> _CachedReduction | None:
        e = self._entries.get(id(t))
        if (e is None or e.tensor() is not t or e.data_ptr != t.data_ptr() or e.shape != t.shape
                or e.layout[3] != t.requires_grad or e.device_type not in devices):
            self.misses += 1
            return None
        self.hits += 1
        return e

    def put(self, t: torch.Tensor, cdata: int, holder: torch.Tensor, v3: bool, storage_type: Any, count: int,
            layout: tuple[Any, ...], view: memoryview | None) -> None:
        key, entries = id(t), self._entries

        def forget(ref: Any) -> None:  # the tensor is gone: so is its entry, and the record holder in it
            entry = entries.get(key)
            if entry is not None and entry.tensor is ref:
                entries.pop(key, None)

        entries[key] = _CachedReduction(weakref.ref(t, forget), t.data_ptr(), t.shape, t.device.type, cdata, holder,
                                        t.dtype, v3, storage_type, count, layout, view)

    def __len__(self) -> int:
        return len(self._entries)


class _CachedReduction(NamedTuple):
    tensor: Any  # weakref.ref to the staging tensor
    data_ptr: int
    shape: torch.Size
    device_type: str
    cdata: int  # the storage's identity
    holder: torch.Tensor  # uint8 tensor of the whole storage (the record)
    dtype: torch.dtype
    v3: bool  # pickled with _rebuild_tensor_v3 (dtypes without a typed storage)
    storage_type: Any
    pid_size: int  # the storage's size in the persistent id: bytes (v3) or elements
    layout: tuple[Any, ...]  # (offset, size, stride, requires_grad)
    view: memoryview | None  # the record's bytes (CPU records)


def plan_pt(obj: Any, *, allow_placeholders: bool = False, cache: ReductionCache | None = None) -> PtPlan:
    """Pickle ``obj`` the way ``torch.save`` does; tensors must be on the CPU.

    Each distinct storage becomes one record holding the storage's bytes, so callers pass tensors that
    own exactly their bytes (the snapshot stage guarantees this), never views into a larger buffer.

    Args:
        allow_placeholders: accept meta tensors as stand-ins for CPU tensors whose bytes arrive only
            while the file is written (host staging budget): pickled exactly like a CPU tensor of that
            layout; the writer gets their bytes from a ``records`` source.
        cache: reductions of tensors pickled before (the staging buffers of earlier saves), reused.
    """
    storages: dict[int, tuple[str, torch.Tensor]] = {}
    dtypes: dict[str, torch.dtype] = {}
    views: dict[str, memoryview] = {}
    devices = ("cpu", "meta") if allow_placeholders else ("cpu",)

    def storage_key(untyped: torch.UntypedStorage) -> str:
        if untyped.device.type not in devices:
            raise ValueError(f"serialize: storage on {untyped.device} reached the writer; stage it to CPU first")
        entry = storages.get(untyped._cdata)
        if entry is None:
            entry = (str(len(storages)), torch.empty(0, dtype=torch.uint8, device=untyped.device).set_(untyped))
            storages[untyped._cdata] = entry
        return entry[0]

    def cached_key(cdata: int, holder: torch.Tensor) -> str:
        entry = storages.get(cdata)
        if entry is None:
            entry = (str(len(storages)), holder)
            storages[cdata] = entry
        return entry[0]

    class _Pickler(pickle.Pickler):
        def reducer_override(self, o: Any) -> Any:
            if type(o) is OrderedDict and not o:
                # Each tensor's empty backward-hooks dict, reduced as its own __reduce__ would (same
                # bytes) without the copyreg lookup that pickling a builtin type repeats every time.
                return OrderedDict, ()
            if type(o) is not torch.Tensor:
                return NotImplemented
            hit = cache.get(o, devices) if cache is not None else None
            if hit is not None:
                key = cached_key(hit.cdata, hit.holder)
                dtypes[key] = hit.dtype
                if hit.view is not None:
                    views[key] = hit.view
                return _reduction(hit.v3, _StorageRef(("storage", hit.storage_type, key, "cpu", hit.pid_size)), hit.layout, hit.dtype)
            # Fast path for plain dense CPU tensors: the same reduction Tensor.__reduce_ex__ produces,
            # without its Python-heavy generic path (it holds the GIL ~0.1 ms per tensor, which the
            # training thread feels while a large optimizer state is pickled in the background).
            if o.device.type not in devices or o.layout != torch.strided or o.is_conj() or o.is_neg():
                return NotImplemented
            untyped = o.untyped_storage()
            key = storage_key(untyped)
            dtypes[key] = o.dtype
            v3 = o.dtype in _V3_DTYPES
            storage_type: Any = torch.UntypedStorage if v3 else getattr(torch, _STORAGE_TYPE_NAMES[o.dtype])
            count = untyped.nbytes() if v3 else untyped.nbytes() // o.element_size()
            layout = (o.storage_offset(), tuple(o.size()), o.stride(), o.requires_grad)
            if cache is not None:
                holder = storages[untyped._cdata][1]
                view = storage_view(holder) if holder.device.type == "cpu" else None
                if view is not None:
                    views[key] = view
                cache.put(o, untyped._cdata, holder, v3, storage_type, count, layout, view)
            return _reduction(v3, _StorageRef(("storage", storage_type, key, "cpu", count)), layout, o.dtype)

        def persistent_id(self, o: Any) -> Any:
            # Called for every object pickled (thousands per optimizer state): the common types leave first.
            t = type(o)
            if t is _StorageRef:
                return o.pid
            if t in _NOT_STORAGES:
                return None
            if isinstance(o, torch.storage.TypedStorage):
                key = storage_key(o._untyped_storage)
                dtypes[key] = o.dtype
                return ("storage", getattr(torch, o._pickle_storage_type()), key, "cpu", o._size())
            if isinstance(o, torch.UntypedStorage):
                return ("storage", torch.UntypedStorage, storage_key(o), "cpu", o.nbytes())
            return None

    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(obj)
    return PtPlan(pickle_bytes=buf.getvalue(), storages=list(storages.values()), dtypes=dtypes, views=views)


def _reduction(v3: bool, ref: _StorageRef, layout: tuple[Any, ...], dtype: torch.dtype) -> tuple[Any, tuple[Any, ...]]:
    """What ``Tensor.__reduce_ex__`` gives a dense CPU tensor; ``layout`` = (offset, size, stride,
    requires_grad). Every tensor gets its own empty backward-hooks dict, as ``torch.save`` writes
    (one shared dict would be memoized by the pickle and shared by the loaded tensors)."""
    if v3:
        return torch._utils._rebuild_tensor_v3, (ref, *layout, OrderedDict(), dtype)
    return torch._utils._rebuild_tensor_v2, (ref, *layout, OrderedDict())


def write_pt(plan: PtPlan, sink: Sink, dtypes: dict[str, torch.dtype] | None = None, records: Any = None) -> None:
    """Write the zip container of ``plan`` into ``sink`` (stored members, data descriptors).

    ``sink`` must not be seekable (or not claim to be), so the zip writer streams with data
    descriptors instead of seeking back; CRC-32 of each record is computed as it streams.
    Args:
        dtypes: optional element dtype per record key, set on ``sink.dtype_hint`` while that record's
            bytes pass (a codec uses it to pick a float-aware transform).
        records: host budget: ``records.views(key)`` yields the bytes of placeholder (meta) records
            piece by piece (``chunkstream.FileRecords``).
    """
    stream = WriteOnlyStream(sink)
    with zipfile.ZipFile(stream, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        _put(zf, "data.pkl", plan.pickle_bytes)
        _put(zf, ".format_version", b"1")
        _put(zf, ".storage_alignment", b"64")
        _put(zf, "byteorder", sys.byteorder.encode())
        for key, holder in plan.storages:
            nbytes = holder.untyped_storage().nbytes()
            info = zipfile.ZipInfo(f"{ARCHIVE_DIR}/data/{key}", date_time=(1980, 1, 1, 0, 0, 0))
            info.file_size = nbytes
            with zf.open(info, "w", force_zip64=nbytes >= 0xFFFF0000) as member:
                if nbytes:
                    if hasattr(sink, "dtype_hint"):
                        sink.dtype_hint = (dtypes or {}).get(key)  # type: ignore[attr-defined]
                    try:
                        if holder.device.type == "meta":
                            if records is None:
                                raise ValueError(f"serialize: record {key} is a placeholder and no records source was given")
                            for view in records.views(key):
                                member.write(view)
                        else:
                            member.write(storage_view(holder))
                    finally:
                        if hasattr(sink, "dtype_hint"):
                            sink.dtype_hint = None  # type: ignore[attr-defined]
        _put(zf, "version", b"3\n")


def storage_view(t: torch.Tensor) -> memoryview:
    """Zero-copy byte view of a CPU tensor's whole storage."""
    storage = t.untyped_storage()
    nbytes = storage.nbytes()
    if nbytes == 0:
        return memoryview(b"")
    if t.dtype == torch.uint8 and t.storage_offset() == 0 and t.numel() == nbytes and t.is_contiguous():
        return byte_view(t)  # already the whole storage (plan_pt's record holders)
    flat = torch.empty(0, dtype=torch.uint8).set_(storage)
    return byte_view(flat)


def _put(zf: zipfile.ZipFile, name: str, data: bytes) -> None:
    info = zipfile.ZipInfo(f"{ARCHIVE_DIR}/{name}", date_time=(1980, 1, 1, 0, 0, 0))
    zf.writestr(info, data)


__all__ = ["PtPlan", "ReductionCache", "Sink", "plan_pt", "storage_view", "write_pt"]
