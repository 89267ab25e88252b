"""The persist process's encoder: a compressed file's native bytes encoded and written there.

Loaded by path by :mod:`checkpointd.storage.persist_process_main`, which imports nothing of the package;
the codecs are imported here on the first ``encode`` request, with the package as a bare namespace (its
``__init__`` imports torch, the codec modules do not): :mod:`checkpointd.codecs.chunked` cuts the stream
into chunks and hands their frames over in order, :mod:`checkpointd.codecs.planes` and
:mod:`checkpointd.codecs.zstd_frames` encode them, on the process's pool; a :class:`MappedSink` copies
them into a mapping of the file on the same pool (memory file systems), a :class:`FileSink` writes them
with ``pwrite`` (elsewhere).
"""

from __future__ import annotations

import ctypes
import importlib
import os
import sys
import types
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def encode_file(codec: str, level: int, chunk_bytes: int, pieces: list, slabs: dict[int, Any],
                pool: ThreadPoolExecutor, out: Any) -> int:
    """Encode the native file ``pieces`` (inline ``(0, bytes, hint)``, ranges of ``slabs`` ``(1, slab_id, start,
    length, hint)``, and records encoded into chunk frames already ``(2, slab_id, start, native length,
    [(offset, frame bytes, native bytes), ...])``, whose frames take at most the native length) with
    ``codec`` into ``out`` (a :class:`FileSink` or :class:`MappedSink`); the native size."""
    encode, preamble, footer_magic = _encoding(codec, level)
    encoder = _module("codecs.chunked").ChunkedEncoder(
        encode, out, chunk_bytes=chunk_bytes, executor=pool, max_inflight=2 * pool._max_workers,
        footer_magic=footer_magic, preamble=preamble)
    for piece in pieces:
        if piece[0] == 0:
            view, hint = memoryview(piece[1]), piece[2]
        else:
            slab = slabs.get(piece[1])
            if slab is None:
                raise ValueError(f"slab {piece[1]} is not mapped")
            view, hint = slab.view[piece[2]:piece[2] + piece[3]], piece[4]
        if piece[0] == 2:  # frames encoded on the device: written as they are
            encoder.write_frames(view, hint)
            continue
        encoder.dtype_hint = hint
        encoder.write(view)
    encoder.close()
    out.finish()
    return encoder.native_nbytes


def encoded_bound(pieces: list, chunk_bytes: int) -> int:
    """At most how many bytes the encoded file of ``pieces`` takes (what a mapping of it must hold).

    A chunk is stored as it is when coding does not make it smaller, so each costs at most its native
    bytes and its headers (frame, chunk, a plane table of 8 planes, its seek-table entry: 96 bytes);
    a file has at most one chunk per ``chunk_bytes`` plus two per piece (the ends of a cut write, a
    pending chunk flushed before it), the banner and the seek table's own header and footer. Frames
    encoded already take their own size and their seek-table entry (reserving the native size for them
    would allocate a fifth more memory on tmpfs than a planes file takes)."""
    native = sum(len(piece[1]) if piece[0] == 0 else piece[3] for piece in pieces if piece[0] != 2)
    framed = sum(frame[1] + 8 for piece in pieces if piece[0] == 2 for frame in piece[4])  # and its entry
    chunks = native // max(1, chunk_bytes) + 2 * len(pieces) + 2
    return native + framed + 128 * chunks + 4096


class FileSink:
    """Encoded bytes into a file front to back with ``pwrite``, their CRC-32 kept as they pass (file
    systems that are not in memory: buffered writes into one file serialise anyway)."""

    def __init__(self, fd: int, crc32: Callable[..., int], pwrite_all: Callable[[int, Any, int], None]) -> None:
        self.fd, self._crc32, self._pwrite_all = fd, crc32, pwrite_all
        self.offset = 0
        self.crc = 0

    def write(self, data: memoryview) -> int:
        self._pwrite_all(self.fd, data, self.offset)
        self.crc = self._crc32(data, self.crc)
        self.offset += data.nbytes
        return data.nbytes

    def finish(self) -> None:
        """Nothing is pending: every write was done in its call."""


class MappedSink:
    """Encoded bytes copied into a shared mapping of the file by the pool's threads, each part with its
    own CRC-32, combined in file order.

    Why: the encoded parts arrive in order on one thread, and one thread's ``pwrite`` into a file on
    tmpfs runs at ~2-3 GB/s (the inode lock serialises them: :mod:`checkpointd.storage.writemode`);
    copies into a mapping run on every thread at once. At most ``2 x`` the pool's threads parts are
    pending; :meth:`finish` waits for them all (and must run, even after a failure, before the mapping
    goes).
    """

    def __init__(self, base: int, capacity: int, pool: ThreadPoolExecutor, crc32: Callable[..., int],
                 crc32_combine: Callable[[int, int, int], int]) -> None:
        self._base, self._capacity, self._pool = base, capacity, pool
        self._crc32, self._combine = crc32, crc32_combine
        self._pending: deque[tuple[Future[int], int]] = deque()
        self._limit = 2 * pool._max_workers
        self.offset = 0
        self.crc = 0

    def write(self, data: memoryview) -> int:
        n = data.nbytes
        if self.offset + n > self._capacity:
            raise ValueError(f"encoded file passes its bound of {self._capacity} bytes")
        if n:
            self._pending.append((self._pool.submit(self._copy, data, self.offset), n))
            self.offset += n
            while len(self._pending) > self._limit or (self._pending and self._pending[0][0].done()):
                self._fold()
        return n

    def _copy(self, data: memoryview, offset: int) -> int:
        source = _module("native.planes").address(data)  # (read-only buffers too)
        ctypes.memmove(self._base + offset, source, data.nbytes)  # ctypes calls drop the GIL
        return int(self._crc32(data))

    def _fold(self) -> None:
        future, n = self._pending.popleft()
        self.crc = self._combine(self.crc, future.result(), n)

    def finish(self) -> None:
        """Wait for every pending copy; the first failure is raised once all have ended."""
        failure = None
        while self._pending:
            try:
                self._fold()
            except BaseException as exc:  # noqa: BLE001 - the others must end before the mapping goes
                failure = failure or exc
        if failure is not None:
            raise failure


def _module(name: str) -> Any:
    """``checkpointd.<name>``, imported without running the package's ``__init__``."""
    if "checkpointd" not in sys.modules:
        package = types.ModuleType("checkpointd")
        package.__path__ = [_PACKAGE_DIR]
        sys.modules["checkpointd"] = package
    return importlib.import_module(f"checkpointd.{name}")


def _encoding(codec: str, level: int) -> tuple[Callable[[memoryview, Any], list[Any]], list[bytes], int]:
    """``(encode(view, element size), opening frames, footer magic)`` of ``codec``; a chunk's hint is the
    element size of its float record (0 or None: not floats), as :mod:`checkpointd.codecs.compress` has it."""
    container, planes, frames = _module("codecs.container"), _module("codecs.planes"), _module("codecs.zstd_frames")
    if codec == "zstd":
        return (lambda view, _hint: [frames.compressor(level).compress(view)]), [], container.SEEKABLE_FOOTER_MAGIC
    if codec == "zstd-planes":
        return ((lambda view, hint: planes.encode_chunk(view, hint or 0, level)), [planes.banner_frame()],
                container.PLANES_FOOTER_MAGIC)
    raise ValueError(f"no encoder for codec {codec!r}")
