"""Precomputed zip layout: write a ``.pt`` (or ``.mdlus``) file with positional writes from many threads.

Why: the streaming writer (:func:`checkpointd.format.serialize.write_pt`) produces the file front to back on
one thread, and the CRC-32 of every byte is computed twice on that thread (zip member CRC, then the
manifest checksum). On a local file, every record's size is known from the plan, so the whole zip
layout can be computed before a byte is written:

    [local header 0][data.pkl] ... [local header k][record k, aligned] ... [central directory][end]

Local headers carry CRC and sizes (no data descriptors), with a padding extra field so every tensor
record starts on an aligned offset (64 bytes, as ``.storage_alignment`` says; 4 KiB for records of
64 KiB or more, which keeps writes page-aligned and suits ``torch.load(mmap=True)``). Then:

1. the file is sized with ``ftruncate``; record bytes are cut into chunks (16 MiB by default) that a
   shared thread pool writes with ``os.pwrite`` straight from the staged tensors (no copy), computing
   each chunk's CRC-32 on the same thread, slice by slice while the slice is in cache;
2. member CRCs are combined from chunk CRCs (:mod:`checkpointd.codecs.crc`), then headers, central directory
   and end records are generated and written;
3. the CRC-32 of the whole file (the manifest checksum) is combined from all pieces in file order:
   every byte is read exactly once, by the thread that writes it.

Two ways to put the bytes in the file (``CHECKPOINTD_WRITE_MODE``): ``pwrite`` (default) and ``mmap``;
``auto`` maps files on tmpfs and uses ``pwrite`` elsewhere (see :func:`write_mode` for why ``pwrite`` is
the default).
Linux serialises buffered writes into one file (the inode lock), so ``pwrite`` from many threads runs
at one thread's speed per file (~3 GB/s on tmpfs); copying into a shared mapping of the pre-sized file
scales with threads (measured on 2 cores: 1.44 -> 2.61 GB/s, pwrite 2.50 -> 2.26). ``mmap`` reserves the
space with ``posix_fallocate`` first, so a full disk fails with ENOSPC rather than SIGBUS. On a 16-core
host (3 GB, one file): tmpfs ``pwrite`` 2.6-3.1 GB/s at any thread count, ``mmap`` 5.2 GB/s at 8-16
threads; ext4 ~1.5 GB/s either way (``benchmarks/RESULTS.md``).

Records staged in shared memory (:mod:`checkpointd.storage.sharedmem`, the default on Linux) are not written
by this process at all: :class:`_SharedPieces` hands their ranges to the persist process
(:mod:`checkpointd.storage.persist_process`), which maps the file and fills it from its own threads (its GIL,
page faults and memory-map lock are not the training's) and returns the slice CRCs; this process
writes the rest (the pickle, small members) by ``pwrite`` meanwhile. What follows describes the
in-process writes, which are also the fallback when the persist process is unavailable.

Under a host staging budget some records' bytes are not in memory when the layout is computed: they
are :class:`Deferred` members (only the size is known), and a ``fill`` callback of the chunk stream
writes them as their chunks arrive (``chunkstream.FileRecords.fill``), with the CRCs combined the same way.

``.mdlus`` files nest a ``.pt`` image as the stored member ``model.pt``; its layout is computed the
same way, relative to its own start, and its CRC combined from its pieces.

The files are ordinary zips: Python's ``zipfile``, ``torch.load`` (miniz) and PhysicsNeMo read them.
Zip64 records are written where a size or offset reaches ``zip64_limit`` (a parameter so tests can
exercise them without 4 GiB files).
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import sys
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from checkpointd.storage import fsinfo
from checkpointd.storage import localpaths
from checkpointd.storage import recycle
from checkpointd.codecs.crc import crc32, crc32_combine
from checkpointd.storage.lanes import run_in_lanes

logger = logging.getLogger("checkpointd")

ZIP64_LIMIT = 0xFFFFFFFF
"""Sizes and offsets at or above this go to zip64 extra fields (the format's own limit)."""
DEFAULT_CHUNK_BYTES = 8 << 20
"""Bytes per write task."""
CRC_SLICE_BYTES = max(64 << 10, int(float(os.environ.get("CHECKPOINTD_WRITE_SLICE_MB", "") or 1) * (1 << 20)))
"""Within a task, CRC then write this much at a time, so the write reads the bytes from cache."""
SMALL_ALIGN = 64
LARGE_ALIGN = 4096
LARGE_RECORD_BYTES = 64 << 10

_DOS_DATE = (0 << 9) | (1 << 5) | 1  # 1980-01-01
_DOS_TIME = 0
_LOCAL = struct.Struct("<IHHHHHIIIHH")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_EOCD = struct.Struct("<IHHHHIIH")
_EOCD64 = struct.Struct("<IQHHIIQQQQ")
_LOCATOR64 = struct.Struct("<IIQI")
_PAD_EXTRA_ID = 0x4246  # "FB": the padding field PyTorch's own writer uses

# -- the thread pool ----------------------------------------------------------------------------------

_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_in_pool = threading.local()


IO_THREADS_ENV = "CHECKPOINTD_IO_THREADS"
"""Size of the shared I/O pool (default ``min(32, max(4, cpu_count))``)."""
WRITE_LANES_ENV = "CHECKPOINTD_WRITE_THREADS_PER_FILE"
"""See :func:`write_lanes`."""


def _mark_pool_thread() -> None:
    _in_pool.flag = True


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, "") or default)
    except ValueError:
        return default


def io_threads() -> int:
    """The I/O pool's size: ``CHECKPOINTD_IO_THREADS`` or ``min(32, max(4, cpu_count))``."""
    return max(1, _env_int(IO_THREADS_ENV, min(32, max(4, os.cpu_count() or 1))))


def io_executor() -> ThreadPoolExecutor:
    """The shared pool for positional reads and writes (:func:`io_threads` threads).

    Tasks on it never wait on other tasks of it, so files of one save (each driven from a writer
    thread) and the chunks within them share it without deadlock.
    """
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=io_threads(), thread_name_prefix="checkpointd-io",
                                       initializer=_mark_pool_thread)
        return _pool


def in_io_pool() -> bool:
    return bool(getattr(_in_pool, "flag", False))


def run_tasks(fns: list[Callable[[], Any]], executor: Executor | None = None, lanes: int | None = None,
              meanwhile: Callable[[], None] | None = None) -> list[Any]:
    """Run ``fns`` on the pool (inline when called from one of its threads); results in order.

    ``lanes``: at most this many of ``fns`` run at once (each lane runs the next task when its
    current one ends), so that several callers share the pool instead of the first queueing all of
    its tasks ahead of the others. On the first failure, tasks not yet started are cancelled (or
    skipped), running ones are waited for, and the failure is raised. ``meanwhile``: run on the
    calling thread while the tasks run (before them when they run inline), exactly once.
    """
    if not fns or len(fns) == 1 or (executor is None and in_io_pool()):
        if meanwhile is not None:
            meanwhile()
        return [fn() for fn in fns]
    pool = executor or io_executor()
    if lanes is not None and 0 < lanes < len(fns):
        if meanwhile is not None:
            meanwhile()
        return run_in_lanes(fns, pool, lanes)
    futures: list[Future[Any]] = [pool.submit(fn) for fn in fns]
    try:
        if meanwhile is not None:
            meanwhile()
        return [f.result() for f in futures]
    except BaseException:
        for f in futures:
            f.cancel()
        for f in futures:
            if not f.cancelled():
                try:
                    f.exception()
                except BaseException:  # noqa: BLE001 - waiting only
                    pass
        raise


FAST_PERSIST_ENV = "CHECKPOINTD_PERSIST"
"""``gentle`` (default) or ``fast``: how this process writes a save's files while training goes on.

It concerns in-process writes only: records that the persist process writes (the default for staged
tensors, :mod:`checkpointd.storage.persist_process`) are always written at full speed there.

``gentle`` writes each file with :func:`write_lanes` threads by ``pwrite``, which the training steps
barely feel. ``fast`` (also used for every save a preemption signal triggers, which the job's grace
period waits for) maps files on memory file systems and puts every I/O thread on each mapped file
(positional writes elsewhere keep :func:`write_lanes`: one file's writes serialise anyway). Measured
on an H200 host (16 cores, tmpfs, 4.8 GB): gentle persisted at 4.1-4.7 GB/s and cost the training
steps that ran meanwhile ~1 ms; fast persisted at 6.7 GB/s (0.93x the best raw write of the same run)
and cost them ~190 ms per checkpoint (page faults on the mappings contend with the training process)."""


def fast_persist() -> bool:
    """Whether ``CHECKPOINTD_PERSIST=fast`` asks for fast writes of every save."""
    return os.environ.get(FAST_PERSIST_ENV, "gentle").strip().lower() == "fast"


def write_lanes() -> int:
    """Threads that write one file at once: ``CHECKPOINTD_WRITE_THREADS_PER_FILE``, default 4.

    More do not write faster: buffered writes to one file serialise on the file's inode lock (tmpfs,
    ext4, xfs). Measured on an H200 host (16 cores, tmpfs, 5 GB from pinned memory): 4 threads wrote
    one file at 3.0-3.1 GB/s, 16 threads at 1.7-2.8 GB/s, and the 16 cost the training steps that
    ran meanwhile 10-16 ms against 0-5 ms. Files of one save are written side by side, each with
    its own lanes.
    """
    return max(1, _env_int(WRITE_LANES_ENV, 4))


# -- layout ---------------------------------------------------------------------------------------------


@dataclass
class Piece:
    """A contiguous byte range of the file: given bytes (``data``) or bytes generated at finalize."""

    offset: int
    length: int
    data: Any = None
    crc: int | None = None


@dataclass(frozen=True)
class Deferred:
    """Member content whose bytes arrive while the file is written (host budget); the size is known."""

    key: str
    nbytes: int


@dataclass
class _Member:
    name: bytes
    header: Piece
    data_offset: int
    size: int
    content: list[Piece] | ZipImage
    crc: int = 0


@dataclass
class ZipImage:
    """A zip whose every offset is fixed; pieces in file order once :meth:`pieces` is called."""

    origin: int
    zip64_limit: int
    members: list[_Member] = field(default_factory=list)
    trailer: Piece | None = None
    end: int = 0

    def pieces(self) -> list[Piece]:
        out: list[Piece] = []
        for m in self.members:
            out.append(m.header)
            out.extend(m.content.pieces() if isinstance(m.content, ZipImage) else m.content)
        assert self.trailer is not None
        out.append(self.trailer)
        return out

    def data_pieces(self) -> list[Piece]:
        """Pieces of member contents (known bytes, or :class:`Deferred`), in file order."""
        out: list[Piece] = []
        for m in self.members:
            if isinstance(m.content, ZipImage):
                out.extend(m.content.data_pieces())
            else:
                out.extend(m.content)
        return out

    def finalize(self) -> list[Piece]:
        """Generate headers and trailer from the data pieces' CRCs; returns the generated pieces."""
        generated: list[Piece] = []
        for m in self.members:
            if isinstance(m.content, ZipImage):
                generated.extend(m.content.finalize())
                parts = m.content.pieces()
            else:
                parts = m.content
            crc = 0
            for p in parts:
                assert p.crc is not None, "a piece was not written"
                crc = crc32_combine(crc, p.crc, p.length)
            m.crc = crc
            m.header.data = self._local_header(m)
            assert len(m.header.data) == m.header.length
            generated.append(m.header)
        assert self.trailer is not None
        self.trailer.data = self._trailer()
        assert len(self.trailer.data) == self.trailer.length
        generated.append(self.trailer)
        for p in generated:
            p.crc = crc32(p.data)
        return generated

    # -- encoding --------------------------------------------------------------------------------
    def _local_header(self, m: _Member) -> bytes:
        zip64 = m.size >= self.zip64_limit
        extra = struct.pack("<HHQQ", 1, 16, m.size, m.size) if zip64 else b""
        fixed = _LOCAL.size + len(m.name) + len(extra)
        pad = m.header.length - fixed
        if pad:
            extra += struct.pack("<HH", _PAD_EXTRA_ID, pad - 4) + b"\0" * (pad - 4)
        size32 = 0xFFFFFFFF if zip64 else m.size
        return _LOCAL.pack(0x04034B50, 45 if zip64 else 20, _flags(m.name), 0, _DOS_TIME, _DOS_DATE, m.crc,
                           size32, size32, len(m.name), len(extra)) + m.name + extra

    def _trailer(self) -> bytes:
        lim = self.zip64_limit
        cd = bytearray()
        for m in self.members:
            rel = m.header.offset - self.origin
            extra = b""
            if m.size >= lim:
                extra += struct.pack("<QQ", m.size, m.size)
            if rel >= lim:
                extra += struct.pack("<Q", rel)
            if extra:
                extra = struct.pack("<HH", 1, len(extra)) + extra
            version = 45 if extra else 20
            size32 = 0xFFFFFFFF if m.size >= lim else m.size
            cd += _CENTRAL.pack(0x02014B50, version, version, _flags(m.name), 0, _DOS_TIME, _DOS_DATE, m.crc,
                                size32, size32, len(m.name), len(extra), 0, 0, 0, 0,
                                0xFFFFFFFF if rel >= lim else rel)
            cd += m.name + extra
        cd_offset = self.trailer.offset - self.origin  # type: ignore[union-attr]
        n = len(self.members)
        out = bytes(cd)
        if _needs_zip64_end(n, len(cd), cd_offset, lim):
            eocd64_offset = cd_offset + len(cd)
            out += _EOCD64.pack(0x06064B50, _EOCD64.size - 12, 45, 45, 0, 0, n, n, len(cd), cd_offset)
            out += _LOCATOR64.pack(0x07064B50, 0, eocd64_offset, 1)
            out += _EOCD.pack(0x06054B50, 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0)
        else:
            out += _EOCD.pack(0x06054B50, 0, 0, n, n, len(cd), cd_offset, 0)
        return out


def _flags(name: bytes) -> int:
    try:
        name.decode("ascii")
        return 0
    except UnicodeDecodeError:
        return 0x800


def _needs_zip64_end(n: int, cd_size: int, cd_offset: int, lim: int) -> bool:
    return n >= 0xFFFF or cd_size >= lim or cd_offset >= lim


def _central_size(name: bytes, size: int, rel_offset: int, lim: int) -> int:
    extra = (16 if size >= lim else 0) + (8 if rel_offset >= lim else 0)
    return _CENTRAL.size + len(name) + (4 + extra if extra else 0)


Content = Any
"""A member's content: ``bytes`` / ``memoryview`` (one piece), or a callable ``origin -> ZipImage``."""


def build_zip(members: Iterable[tuple[str, Content, int]], origin: int = 0,
              zip64_limit: int = ZIP64_LIMIT) -> ZipImage:
    """Lay out a stored zip starting at file offset ``origin``.

    Args:
        members: ``(name, content, alignment)``: data starts at a multiple of ``alignment`` counted
            from ``origin`` (1 for none). A callable content builds a nested zip at the origin it is given.
    """
    img = ZipImage(origin=origin, zip64_limit=zip64_limit)
    pos = origin
    cd_size = 0
    for name, content, align in members:
        bname = name.encode("utf-8")
        fixed = _LOCAL.size + len(bname)
        header_offset = pos
        # The zip64 decision depends on the size, which a nested image knows only once built at its
        # origin; its origin depends on the header length. Nested images are never aligned differently
        # by a zip64 field: compute the header assuming no zip64, build, and redo if the size says so.
        for zip64 in (False, True):
            hdr_len = fixed + (20 if zip64 else 0)
            pad = (-(pos + hdr_len - origin)) % align if align > 1 else 0
            if 0 < pad < 4:
                pad += align
            hdr_len += pad
            data_offset = pos + hdr_len
            if isinstance(content, Deferred):
                size = content.nbytes
                body: list[Piece] | ZipImage = [Piece(data_offset, size, content)]
            elif callable(content):
                body = content(data_offset)
                size = body.end - data_offset  # type: ignore[union-attr]
            else:
                view = memoryview(content).cast("B")
                size = view.nbytes
                body = [Piece(data_offset, size, view)]
            if (size >= zip64_limit) == zip64:
                break
        m = _Member(name=bname, header=Piece(header_offset, hdr_len), data_offset=data_offset, size=size, content=body)
        img.members.append(m)
        cd_size += _central_size(bname, size, header_offset - origin, zip64_limit)
        pos = data_offset + size
    n = len(img.members)
    trailer_len = cd_size + _EOCD.size
    if _needs_zip64_end(n, cd_size, pos - origin, zip64_limit):
        trailer_len += _EOCD64.size + _LOCATOR64.size
    img.trailer = Piece(pos, trailer_len)
    img.end = pos + trailer_len
    return img


def pt_members(plan: Any, align_small: int = SMALL_ALIGN, align_large: int = LARGE_ALIGN) -> list[tuple[str, Content, int]]:
    """The members of a ``.pt`` file, exactly those :func:`checkpointd.format.serialize.write_pt` writes."""
    from checkpointd.format.serialize import ARCHIVE_DIR, storage_view

    a = ARCHIVE_DIR
    out: list[tuple[str, Content, int]] = [
        (f"{a}/data.pkl", plan.pickle_bytes, 1),
        (f"{a}/.format_version", b"1", 1),
        (f"{a}/.storage_alignment", str(align_small).encode(), 1),
        (f"{a}/byteorder", sys.byteorder.encode(), 1),
    ]
    kept = getattr(plan, "views", {})  # byte views a ReductionCache kept from earlier saves
    for key, holder in plan.storages:
        view: Any = kept.get(key)
        if view is None:
            view = Deferred(key, holder.untyped_storage().nbytes()) if holder.device.type == "meta" else storage_view(holder)
        nbytes = view.nbytes
        out.append((f"{a}/data/{key}", view, align_large if nbytes >= LARGE_RECORD_BYTES else align_small))
    out.append((f"{a}/version", b"3\n", 1))
    return out


def pt_image(plan: Any, origin: int = 0, zip64_limit: int = ZIP64_LIMIT) -> ZipImage:
    return build_zip(pt_members(plan), origin, zip64_limit)


def mdlus_image(json_members: dict[str, bytes], plan: Any, zip64_limit: int = ZIP64_LIMIT) -> ZipImage:
    """The ``.mdlus`` zip: ``args.json``, ``metadata.json``, then ``model.pt`` (a nested ``.pt`` image)."""
    from checkpointd.format.mdlus import ARGS_MEMBER, METADATA_MEMBER, MODEL_MEMBER

    missing = {ARGS_MEMBER, METADATA_MEMBER} - json_members.keys()
    if missing:
        raise ValueError(f"mdlus: json_members lacks {sorted(missing)}; build it with mdlus_json_members()")
    return build_zip([
        (ARGS_MEMBER, json_members[ARGS_MEMBER], 1),
        (METADATA_MEMBER, json_members[METADATA_MEMBER], 1),
        (MODEL_MEMBER, lambda origin: pt_image(plan, origin, zip64_limit), LARGE_ALIGN),
    ], 0, zip64_limit)


# -- writing ------------------------------------------------------------------------------------------


@dataclass
class WriteResult:
    nbytes: int
    crc: int
    raw_nbytes: int
    recycled: bool = False
    """:func:`write_file` wrote over a file taken from the recycling bin (retired, or blank made ahead)."""


def _put_task(put: Callable[[Any, int], None], work: list[tuple[int, Any]],
              written: Callable[[int, int], None] | None = None) -> list[int]:
    """Put ``(offset, view)`` pieces into the file with ``put(slice, offset)``, CRC-32 of each slice
    computed just before it is put (while it is in cache); ``written(offset, nbytes)`` after each piece."""
    crcs = []
    for offset, view in work:
        crc = 0
        for pos in range(0, view.nbytes, CRC_SLICE_BYTES):
            part = view[pos:pos + CRC_SLICE_BYTES]
            crc = crc32(part, crc)
            put(part, offset + pos)
        crcs.append(crc)
        if written is not None:
            written(offset, view.nbytes)
    return crcs


def plan_tasks(pieces: list[Piece], chunk_bytes: int) -> list[list[tuple[Piece, int, int]]]:
    """Group ``pieces`` into tasks of about ``chunk_bytes``: lists of ``(piece, start, stop)`` ranges."""
    tasks: list[list[tuple[Piece, int, int]]] = []
    current: list[tuple[Piece, int, int]] = []
    filled = 0
    for p in pieces:
        start = 0
        while start < p.length:
            stop = min(p.length, start + chunk_bytes - filled)
            current.append((p, start, stop))
            filled += stop - start
            start = stop
            if filled >= chunk_bytes:
                tasks.append(current)
                current, filled = [], 0
    if current:
        tasks.append(current)
    return tasks


def write_mode(fd: int | None = None) -> str:
    """``pwrite`` or ``mmap`` for the file ``fd``: environment ``CHECKPOINTD_WRITE_MODE`` (``pwrite``, the
    default; ``mmap``; ``auto``: ``mmap`` on memory-backed filesystems such as tmpfs, ``pwrite`` elsewhere).

    ``pwrite`` is the default although ``mmap`` persists ~2x faster on tmpfs: measured on an H200 host,
    16 threads faulting pages of a mapping slowed the *training* steps that ran meanwhile by ~220 ms per
    checkpoint (page faults and the training process's own memory mappings share one lock), against
    ~25 ms for ``pwrite``. Use ``mmap``/``auto`` where persist time matters more than the training stall
    (a final or preemption save, a process that only writes).
    """
    return _resolve_mode(os.environ.get("CHECKPOINTD_WRITE_MODE", "pwrite").strip().lower(), fd)


def _resolve_mode(mode: str, fd: int | None) -> str:
    if mode != "auto":
        return mode if mode in ("pwrite", "mmap") else "pwrite"
    if fd is None:
        return "pwrite"
    from checkpointd.storage.fsinfo import fd_filesystem_type, is_memory_backed

    return "mmap" if is_memory_backed(fd_filesystem_type(fd)) else "pwrite"


FillFn = Callable[[dict[str, Piece], Callable[[Any, int], None], Callable[[int, int], None] | None, Any],
                  list[tuple[Piece, int, int, int]]]
"""``fill(deferred pieces by key, put, written, remote) -> [(piece, start, stop, crc)]``: writes
:class:`Deferred` members; ``written(offset, nbytes)`` (or None) after each range is put, as
:func:`_put_task`'s; ``remote``: the file attached to the persist process
(:class:`checkpointd.storage.persist_process.RemoteFile`, or None), for bytes that arrive in shared memory."""


def write_image(fd: int, img: ZipImage, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                executor: Executor | None = None, mode: str | None = None, fill: FillFn | None = None,
                fast: bool = False) -> WriteResult:
    """Write ``img`` into the open file ``fd`` (from offset ``img.origin``) from many threads.

    The caller owns ``fd`` (opening, fsync, closing, removal on failure). ``mode``: see the module
    docstring (None reads ``CHECKPOINTD_WRITE_MODE``). ``fill`` writes the :class:`Deferred` members.
    ``fast``: a save nobody trains beside (see :data:`FAST_PERSIST_ENV`): a mapping on memory file
    systems (``auto``) unless ``mode`` says otherwise, and then every I/O thread on this file.
    """
    os.ftruncate(fd, img.end)
    data = img.data_pieces()
    deferred = [p for p in data if isinstance(p.data, Deferred)]
    if deferred and fill is None:
        raise ValueError("ptlayout: the image has deferred members but no fill was given")
    shared = _SharedPieces([p for p in data if not isinstance(p.data, Deferred)], chunk_bytes, streamed=bool(deferred))
    tasks, local = shared.tasks + shared.local, shared.local
    mapped = None
    chosen = _resolve_mode(mode, fd) if mode is not None else (_resolve_mode("auto", fd) if fast else write_mode(fd))
    if shared.process is not None:
        chosen = "pwrite"  # the process fills the records; here only what is not staged (the pickle, headers)
    if chosen == "mmap" and img.end > 0:
        import numpy as np

        os.posix_fallocate(fd, 0, img.end)  # ENOSPC here, never SIGBUS while copying
        try:
            mapped = mmap.mmap(fd, img.end, access=mmap.ACCESS_WRITE)
        except (PermissionError, ValueError):  # a write-only descriptor cannot be mapped: positional writes
            mapped = None
    if mapped is not None:
        dest = np.frombuffer(mapped, dtype=np.uint8)

        def put(part: Any, offset: int) -> None:
            np.copyto(dest[offset:offset + part.nbytes], np.frombuffer(part, dtype=np.uint8))
    else:
        def put(part: Any, offset: int) -> None:
            fsinfo.pwrite_all(fd, part, offset)

    written = fsinfo.writeback_starter(fd) if fsinfo.early_writeback(fd) else None

    def make(task: list[tuple[Piece, int, int]]) -> Callable[[], list[int]]:
        return lambda: _put_task(put, [(p.offset + a, p.data[a:b]) for p, a, b in task], written)

    remote = shared.submit(fd, img.end, mode, written is not None) if shared.tasks else None
    try:
        # Every thread on one file only into a mapping: positional writes to one file serialise on its
        # inode lock, and 16 threads wrote one tmpfs file slower than 4 (see write_lanes).
        lanes = io_threads() if fast and mapped is not None else write_lanes()
        done = dict(zip(map(id, local), run_tasks([make(t) for t in local], executor, lanes=lanes)))
        if remote is not None:
            done.update(shared.finish(remote, lambda ts: run_tasks([make(t) for t in ts], executor, lanes=lanes)))
            remote = None
        if deferred:
            attached = shared.attach(fd, img.end, mode, written is not None)
            try:
                _combine_filled(fill({p.data.key: p for p in deferred if p.length}, put, written, attached))  # type: ignore[misc]
            finally:
                if attached is not None:
                    attached.detach()
    finally:
        if remote is not None:  # a local failure: let the process finish with the file before it is removed
            remote.exception()
        if mapped is not None:
            del dest, put, make
            mapped.close()  # unmapped: the pages are in the file's page cache; fsync makes them durable
    results = [done[id(t)] for t in tasks]
    for task, crcs in zip(tasks, results):
        for (p, a, b), crc in zip(task, crcs):
            p.crc = crc if p.crc is None or a == 0 else crc32_combine(p.crc, crc, b - a)
    for p in data:
        if p.length == 0:
            p.crc = 0
    generated = img.finalize()
    if shared.process is not None:
        shared.scatter(fd, generated)
    else:
        for p in generated:
            fsinfo.pwrite_all(fd, p.data, p.offset)
    crc = 0
    for p in img.pieces():
        crc = crc32_combine(crc, p.crc, p.length)  # type: ignore[arg-type]
    raw = sum(p.length for p in data)
    return WriteResult(nbytes=img.end - img.origin, crc=crc, raw_nbytes=raw)


def persist_mode(fd: int, mode: str | None = None) -> tuple[str, int]:
    """``(mode, lanes)`` the persist process writes ``fd`` with: ``mode`` or ``CHECKPOINTD_WRITE_MODE``
    (default ``auto``: a mapping on memory file systems, filled by every I/O thread; else :func:`write_lanes`
    positional writers)."""
    chosen = _resolve_mode(mode if mode is not None else os.environ.get("CHECKPOINTD_WRITE_MODE", "auto").strip().lower(), fd)
    return chosen, io_threads() if chosen == "mmap" else write_lanes()


class _SharedPieces:
    """Splits a file's pieces between the persist process and this process.

    ``tasks``: pieces staged in shared memory, in write tasks, written by the process from the slabs.
    ``small``: other pieces under :data:`LARGE_RECORD_BYTES` (the pickle, small members), checksummed
    here and sent with the generated headers in one :meth:`scatter` request at the end. ``local``: the
    rest (large and not staged), written by this process's threads. Without a persist process every
    piece is local.
    """

    def __init__(self, pieces: list[Piece], chunk_bytes: int, streamed: bool = False) -> None:
        """``streamed``: the file has members whose bytes arrive later (:meth:`attach`), so it goes
        through the process when one runs, whatever its known pieces are."""
        from checkpointd.storage import persist_process
        from checkpointd.storage import sharedmem

        self.process = None
        self.tasks: list[list[tuple[Piece, int, int]]] = []
        self.small: list[Piece] = []
        """Small known pieces (with a process): CRC'd here at once, written with the headers by :meth:`scatter`."""
        self.slabs: dict[int, Any] = {}
        where: dict[int, tuple[Any, int]] = {}
        shared = sharedmem.supported()
        if shared:
            for p in pieces:
                found = sharedmem.locate(p.data) if p.length >= LARGE_RECORD_BYTES else None
                if found is not None:
                    where[id(p)] = found
                    self.slabs[found[0].id] = found[0]
        all_small = bool(pieces) and all(p.length < LARGE_RECORD_BYTES for p in pieces)
        if where or (shared and (all_small or streamed)):  # a small file with nothing staged: its headers go there too
            self.process = persist_process.client()
        if self.process is None:
            self.local = plan_tasks(pieces, chunk_bytes)
            return
        self.tasks = plan_tasks([p for p in pieces if id(p) in where], chunk_bytes)
        rest = [p for p in pieces if id(p) not in where]
        self.small = [p for p in rest if 0 < p.length < LARGE_RECORD_BYTES]
        for p in self.small:
            p.crc = crc32(p.data)
        self.local = plan_tasks([p for p in rest if p.length >= LARGE_RECORD_BYTES], chunk_bytes)
        self.ranges = [[(p.offset + a, where[id(p)][0].id, where[id(p)][1] + a, b - a) for p, a, b in task]
                       for task in self.tasks]

    def submit(self, fd: int, end: int, mode: str | None, writeback: bool = False) -> Any:
        """Send the tasks; ``mode`` as :func:`write_image`'s (None: a mapping on memory file systems);
        ``writeback``: the process starts the disk on each range it has written (:func:`fsinfo.early_writeback`)."""
        from checkpointd.storage import persist_process

        chosen, lanes = persist_mode(fd, mode)
        assert self.process is not None
        try:
            return self.process.submit_write(fd, end, chosen, lanes, self.ranges, list(self.slabs.values()), writeback)
        except persist_process.PersistProcessError as exc:
            failed: Future[Any] = Future()
            failed.set_exception(exc)
            return failed

    def attach(self, fd: int, end: int, mode: str | None, writeback: bool) -> Any:
        """The file attached to the persist process for bytes that arrive later in shared memory (a host
        budget's chunks), or None without a process (or when it cannot take it: logged)."""
        from checkpointd.storage import persist_process

        if self.process is None:
            return None
        chosen, lanes = persist_mode(fd, mode)
        try:
            return self.process.attach(fd, end, chosen, lanes, writeback)
        except persist_process.PersistProcessError as exc:
            logger.warning("checkpointd: %s; writing those bytes from this process", exc)
            return None

    def scatter(self, fd: int, generated: list[Piece]) -> None:
        """Write the small pieces and the ``generated`` ones (headers, trailer) through the process in
        one request, adjacent pieces joined; here with ``pwrite`` if the process could not."""
        from checkpointd.storage import persist_process

        runs: list[tuple[int, bytearray]] = []
        for p in sorted((p for p in [*self.small, *generated] if p.length), key=lambda p: p.offset):
            if runs and runs[-1][0] + len(runs[-1][1]) == p.offset:
                runs[-1][1].extend(p.data)
            else:
                runs.append((p.offset, bytearray(p.data)))
        try:
            assert self.process is not None
            self.process.submit_scatter(fd, [(offset, bytes(data)) for offset, data in runs]).result()
            return
        except persist_process.PersistProcessError as exc:
            logger.warning("checkpointd: %s; writing those bytes from this process", exc)
        for offset, data in runs:
            fsinfo.pwrite_all(fd, data, offset)

    def finish(self, future: Any, run_here: Callable[[list[list[tuple[Piece, int, int]]]], list[Any]]) -> dict[int, Any]:
        """The tasks' CRCs by ``id(task)``; written by ``run_here`` if the process could not."""
        from checkpointd.storage import persist_process

        try:
            crcs = future.result()
        except persist_process.PersistProcessError as exc:
            logger.warning("checkpointd: %s; writing those bytes from this process", exc)
            crcs = run_here(self.tasks)
        return dict(zip(map(id, self.tasks), crcs))


def _combine_filled(runs: list[tuple[Piece, int, int, int]]) -> None:
    """Set each deferred piece's CRC from the CRCs of its written ranges, which must cover it exactly."""
    by_piece: dict[int, list[tuple[int, int, int]]] = {}
    pieces: dict[int, Piece] = {}
    for p, a, b, crc in runs:
        by_piece.setdefault(id(p), []).append((a, b, crc))
        pieces[id(p)] = p
    for pid, ranges in by_piece.items():
        p = pieces[pid]
        ranges.sort()
        crc, pos = 0, 0
        for a, b, c in ranges:
            if a != pos:
                raise RuntimeError(f"ptlayout: deferred member bytes [{pos}, {a}) were not written")
            crc = crc32_combine(crc, c, b - a)
            pos = b
        if pos != p.length:
            raise RuntimeError(f"ptlayout: deferred member written up to {pos} of {p.length} bytes")
        p.crc = crc


def write_file(path: str, img: ZipImage, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
               executor: Executor | None = None, durable: bool = True, fill: FillFn | None = None,
               fast: bool = False, recycle_from: str | None = None, root: str | None = None) -> WriteResult:
    """Create ``path`` holding ``img``; fsync'd (file and directory) when ``durable``.

    On any failure the partial file is removed and the error raised. ``fill``, ``fast``: see :func:`write_image`.
    ``recycle_from``: a recycling bin (:mod:`checkpointd.storage.recycle`); a retired file from it becomes
    ``path`` and is written over (:func:`write_image` sets its size first), once its open descriptor
    shows a regular file with no other link.

    ``root``: the checkpoint root ``path`` lies below; the directories between them are then opened
    without following links (a link there raises :class:`checkpointd.errors.LinkedPathError`),
    so nothing outside the root is ever written, whatever links the root holds. Without it, the
    directory of ``path`` is the caller's. Either way ``path`` is never written through: whatever name
    is there is unlinked and a new file created (``O_EXCL|O_NOFOLLOW``), unless a checked retired file
    takes its place.
    """
    if root is not None and path.startswith(root.rstrip("/") + "/"):
        dir_fd, name = localpaths.open_parent_below(root, path[len(root.rstrip("/")) + 1:])
    else:
        dir_fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
        name = os.path.basename(path)
    try:
        return _write_at(dir_fd, name, path, img, chunk_bytes=chunk_bytes, executor=executor, durable=durable,
                         fill=fill, fast=fast, recycle_from=recycle_from)
    finally:
        os.close(dir_fd)


def _write_at(dir_fd: int, name: str, path: str, img: ZipImage, *, chunk_bytes: int, executor: Executor | None,
              durable: bool, fill: FillFn | None, fast: bool, recycle_from: str | None) -> WriteResult:
    """:func:`write_file` into ``name`` of the directory ``dir_fd`` (``path``: for messages)."""
    fd = recycle.take_open(recycle_from, dir_fd, name, img.end) if recycle_from is not None else None
    recycled = fd is not None
    if fd is None:
        fd = localpaths.create_file(dir_fd, name, path, os.O_RDWR)  # RDWR: mmap mode
    try:
        result = write_image(fd, img, chunk_bytes=chunk_bytes, executor=executor, fill=fill, fast=fast)
        result.recycled = recycled
        if durable:
            os.fsync(fd)
    except BaseException:
        try:
            os.close(fd)
        finally:
            try:
                os.unlink(name, dir_fd=dir_fd)
            except OSError:
                pass
        raise
    os.close(fd)
    if durable:
        os.fsync(dir_fd)
    return result


__all__ = ["FAST_PERSIST_ENV", "ZipImage", "build_zip", "fast_persist", "io_executor", "mdlus_image", "pt_image", "run_tasks", "write_file",
           "write_image", "ZIP64_LIMIT"]
