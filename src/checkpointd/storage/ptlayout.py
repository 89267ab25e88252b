"""Write a ``.pt`` (or ``.mdlus``) file with positional writes from many threads, into a precomputed
zip layout.

Why: the streaming writer (:func:`checkpointd.format.serialize.write_pt`) produces the file front to back on
one thread, and the CRC-32 of every byte is computed twice on that thread (zip member CRC, then the
manifest checksum). On a local file the whole zip layout is computed ahead of the bytes
(:mod:`checkpointd.storage.ziplayout`). Then:

1. the file is sized with ``ftruncate``; record bytes are cut into chunks (8 MiB by default) that a
   shared thread pool (:mod:`checkpointd.storage.iopool`) writes straight from the staged tensors (no
   copy), computing each chunk's CRC-32 on the same thread, slice by slice while the slice is in cache;
2. member CRCs are combined from chunk CRCs (:mod:`checkpointd.codecs.crc`), then headers, central directory
   and end records are generated and written;
3. the CRC-32 of the whole file (the manifest checksum) is combined from all pieces in file order:
   every byte is read exactly once, by the thread that writes it.

How the bytes go in (positional writes or a shared mapping, and how many threads a file) is
:mod:`checkpointd.storage.writemode`'s choice. Records staged in shared memory go through the persist
process (:mod:`checkpointd.storage.sharedpieces`); this process writes the rest meanwhile. The
in-process writes are also the fallback when the persist process is unavailable.

Under a host staging budget some records' bytes are not in memory when the layout is computed: they
are :class:`checkpointd.storage.ziplayout.Deferred` members (only the size is known), and a ``fill``
callback of the chunk stream writes them as their chunks arrive (``chunkstream.FileRecords.fill``),
with the CRCs combined the same way.

The names of the layout, the pool and the write modes are importable from here too.
"""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import numpy as np

from checkpointd.codecs.crc import crc32, crc32_combine
from checkpointd.native.planes import address
from checkpointd.storage import fsinfo
from checkpointd.storage import localpaths
from checkpointd.storage import persist_process
from checkpointd.storage import recyclebin
from checkpointd.storage import sharedmem
from checkpointd.storage.iopool import (DEFAULT_CHUNK_BYTES, io_threads, put_task, run_tasks)
from checkpointd.storage.sharedpieces import SharedPieces
from checkpointd.storage.writemode import resolve_mode, write_lanes, write_mode
from checkpointd.storage.ziplayout import LARGE_RECORD_BYTES, Deferred, Piece, ZipImage


logger = logging.getLogger("checkpointd")


@dataclass
class WriteResult:
    """What :func:`write_image` wrote: the file's bytes and CRC-32, and the bytes of member contents."""

    nbytes: int
    crc: int
    raw_nbytes: int
    recycled: bool = False
    """:func:`write_file` wrote over a file taken from the recycling bin (retired, or blank made ahead)."""


FillFn = Callable[[dict[str, Piece], Callable[[Any, int], None], Callable[[int, int], None] | None, Any],
                  list[tuple[Piece, int, int, int]]]
"""``fill(deferred pieces by key, put, written, remote) -> [(piece, start, stop, crc)]``: writes
:class:`Deferred` members; ``written(offset, nbytes)`` (or None) after each range is put, as
:func:`checkpointd.storage.iopool.put_task`'s; ``remote``: the file attached to the persist process
(:class:`checkpointd.storage.persist_process.RemoteFile`, or None), for bytes that arrive in shared memory."""


def write_image(fd: int, img: ZipImage, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                executor: Executor | None = None, mode: str | None = None, fill: FillFn | None = None,
                fast: bool = False) -> WriteResult:
    """Write ``img`` into the open file ``fd`` (from offset ``img.origin``) from many threads.

    The caller owns ``fd`` (opening, fsync, closing, removal on failure). ``mode``: ``pwrite``, ``mmap``
    or ``auto`` (:mod:`checkpointd.storage.writemode`; None: its automatic choice). ``fill`` writes the
    :class:`Deferred` members. ``fast``: a save nobody trains beside
    (:data:`checkpointd.storage.writemode.FAST_PERSIST`): a mapping on memory file systems (``auto``)
    unless ``mode`` says otherwise, and then every I/O thread on this file.
    """
    os.ftruncate(fd, img.end)
    data = img.data_pieces()
    deferred = [p for p in data if isinstance(p.data, Deferred)]
    if deferred and fill is None:
        raise ValueError("ptlayout: the image has deferred members but no fill was given")
    shared = SharedPieces([p for p in data if not isinstance(p.data, Deferred)], chunk_bytes, streamed=bool(deferred))
    tasks, local = shared.tasks + shared.local, shared.local
    mapped = None
    chosen = resolve_mode(mode, fd) if mode is not None else (resolve_mode("auto", fd) if fast else write_mode(fd))
    if shared.process is not None:
        chosen = "pwrite"  # the process fills the records; here only what is not staged (the pickle, headers)
    if chosen == "mmap" and img.end > 0:
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
        return lambda: put_task(put, [(p.offset + a, p.data[a:b]) for p, a, b in task], written)

    remote = shared.submit(fd, img.end, mode, written is not None) if shared.tasks else None
    try:
        # Every thread on one file only into a mapping: positional writes to one file serialise on its
        # inode lock, and 16 threads write one tmpfs file slower than 4 (see write_lanes).
        lanes = io_threads() if fast and mapped is not None else write_lanes()
        done = dict(zip(map(id, local), run_tasks([make(t) for t in local], executor, lanes=lanes)))
        if remote is not None:
            done.update(shared.finish(remote, lambda ts: run_tasks([make(t) for t in ts], executor, lanes=lanes)))
            remote = None
        if deferred:
            attached = shared.attach(fd, img.end, mode, written is not None)
            try:
                combine_filled(fill({p.data.key: p for p in deferred if p.length}, put, written, attached))  # type: ignore[misc]
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


def combine_filled(runs: list[tuple[Piece, int, int, int]]) -> None:
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
    dir_fd, name = _parent(path, root)
    try:
        return _write_at(dir_fd, name, path, img, chunk_bytes=chunk_bytes, executor=executor, durable=durable,
                         fill=fill, fast=fast, recycle_from=recycle_from)
    finally:
        os.close(dir_fd)


def _write_at(dir_fd: int, name: str, path: str, img: ZipImage, *, chunk_bytes: int, executor: Executor | None,
              durable: bool, fill: FillFn | None, fast: bool, recycle_from: str | None) -> WriteResult:
    """:func:`write_file` into ``name`` of the directory ``dir_fd`` (``path``: for messages)."""
    return _create(dir_fd, name, path, img.end, recycle_from, durable,
                   lambda fd: write_image(fd, img, chunk_bytes=chunk_bytes, executor=executor, fill=fill, fast=fast))


def _create(dir_fd: int, name: str, path: str, nbytes: int, recycle_from: str | None, durable: bool,
            write: Callable[[int], WriteResult]) -> WriteResult:
    """``write(fd)`` into a new file ``name`` of ``dir_fd`` (or a retired one of about ``nbytes`` from the
    bin ``recycle_from``), fsync'd (file and directory) when ``durable``; removed on any failure."""
    fd = recyclebin.take_open(recycle_from, dir_fd, name, nbytes) if recycle_from is not None else None
    recycled = fd is not None
    if fd is None:
        fd = localpaths.create_file(dir_fd, name, path, os.O_RDWR)  # RDWR: mmap mode
    try:
        result = write(fd)
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


CRC_SLICE_BYTES = 32 << 20
"""A staged record's CRC-32 is computed in slices of this size, on the persist process's threads at once."""


def write_encoded_file(path: str, img: ZipImage, codec: str, level: int, chunk_bytes: int, hints: dict[int, int],
                       *, root: str | None = None, recycle_from: str | None = None,
                       encoded: dict[int, Any] | None = None) -> WriteResult | None:
    """Create ``path`` holding ``img`` encoded with ``codec``, written by the persist process; fsync'd.

    Why: encoding costs the process that runs it CPU time and, between its native calls, the GIL; in the
    training process the training loop feels both (on an H200 host a 4.8 GB ``zstd-planes`` save cost
    the steps after it about 20 ms more than an uncompressed one). Here the persist process computes the
    member CRCs from the staging slabs, this process makes the headers, and the persist process encodes
    the whole native stream (:class:`checkpointd.codecs.chunked.ChunkedEncoder`) into the file.
    ``hints``: the element size of each float record's pieces, by ``id``. ``recycle_from``: as
    :func:`write_file`'s (a retired file of about the native size is written over, then cut to size).
    ``encoded``: records whose staged bytes hold their chunk frames already (encoded on the device), by
    the address of those bytes (``save.device_encode.Encoded``: frames and the native bytes' CRC-32).

    None, with nothing written, where no persist process takes it (none runs, or it failed: logged) or
    a record of ``encoded`` cannot go as frames; the caller streams the file itself then. Other failures
    remove the partial file and raise.
    """
    process = persist_process.client() if sharedmem.supported() else None
    if process is None:
        return None
    data = img.data_pieces()
    where = {id(p): sharedmem.locate(p.data) if p.length >= LARGE_RECORD_BYTES else None for p in data}
    done = {id(p): e for p in data if where[id(p)] is not None and encoded
            and (e := encoded.get(address(p.data))) is not None and e.native_nbytes == p.length}
    if encoded and sum(1 for p in data if p.length and address(p.data) in encoded) != len(done):
        return None  # bytes that hold frames but would be encoded as native ones: the caller restores them first
    slices = [(p, start, min(CRC_SLICE_BYTES, p.length - start)) for p in data
              if where[id(p)] is not None and id(p) not in done for start in range(0, p.length, CRC_SLICE_BYTES)]
    try:
        crcs = process.submit_crc([(where[id(p)][0], where[id(p)][1] + a, n) for p, a, n in slices]).result()
    except persist_process.PersistProcessError as exc:
        logger.warning("checkpointd: %s; encoding the file in this process", exc)
        return None
    for (p, a, n), crc in zip(slices, crcs):
        p.crc = crc if a == 0 else crc32_combine(p.crc, crc, n)
    for p in data:
        if id(p) in done:
            p.crc = done[id(p)].crc
        elif where[id(p)] is None:
            p.crc = crc32(p.data) if p.length else 0
    img.finalize()
    pieces: list[tuple] = []
    for p in img.pieces():
        found = where.get(id(p))
        hint = hints.get(id(p), 0)
        if id(p) in done:
            pieces.append((2, found[0].id, found[1], p.length, [list(f) for f in done[id(p)].frames]))
        else:
            pieces.append((1, found[0].id, found[1], p.length, hint) if found is not None else (0, bytes(p.data), hint))
    slabs = list({found[0].id: found[0] for found in where.values() if found is not None}.values())

    def encode(fd: int) -> WriteResult:
        return WriteResult(*process.submit_encode(fd, codec, level, chunk_bytes, pieces, slabs).result())

    dir_fd, name = _parent(path, root)
    try:
        return _create(dir_fd, name, path, img.end, recycle_from, True, encode)
    except persist_process.PersistProcessError as exc:
        logger.warning("checkpointd: %s; encoding the file in this process", exc)
        return None
    finally:
        os.close(dir_fd)


def _parent(path: str, root: str | None) -> tuple[int, str]:
    """The open directory of ``path`` and its name there (below ``root`` without following links)."""
    if root is not None and path.startswith(root.rstrip("/") + "/"):
        return localpaths.open_parent_below(root, path[len(root.rstrip("/")) + 1:])
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
    return os.open(os.path.dirname(path) or ".", flags), os.path.basename(path)


__all__ = ["FillFn", "WriteResult", "combine_filled", "write_encoded_file", "write_file", "write_image"]
