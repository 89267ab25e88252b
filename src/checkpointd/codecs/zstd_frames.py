"""Per-thread zstd contexts and scratch arrays, and zstd frames decoded straight into a caller's buffer.

Codec chunks are encoded and decoded on pool threads, one chunk at a time. zstd contexts are not
thread-safe and are costly to make, so each thread keeps its own; temporaries that a chunk needs live
in per-thread scratch arrays reused from chunk to chunk (allocating, faulting in and unmapping 4 MiB
per chunk from many threads at once serializes in the kernel).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import zstandard as zstd

from checkpointd.errors import CorruptCheckpointError

_local = threading.local()


def compressor(level: int) -> zstd.ZstdCompressor:
    """This thread's compressor for ``level``, writing frame checksums."""
    cache = _local.__dict__.setdefault("compressors", {})
    if level not in cache:
        cache[level] = zstd.ZstdCompressor(level=level, write_checksum=True)
    return cache[level]


def _decompressor() -> zstd.ZstdDecompressor:
    dctx = getattr(_local, "decompressor", None)
    if dctx is None:
        dctx = _local.decompressor = zstd.ZstdDecompressor()
    return dctx


def scratch(name: str, nbytes: int) -> np.ndarray:
    """This thread's reusable uint8 array ``name`` of at least ``nbytes`` (sliced to ``nbytes``)."""
    buf = _local.__dict__.get(name)
    if buf is None or buf.nbytes < nbytes:
        buf = np.empty(max(nbytes, 1), dtype=np.uint8)
        _local.__dict__[name] = buf
    return buf[:nbytes]


def zstd_decompress_into(frame: Any, out: np.ndarray) -> None:
    """Decode one zstd frame into ``out`` (uint8, exactly the frame's content size), checksum checked."""
    try:
        with _decompressor().stream_reader(frame, read_across_frames=False, closefd=False) as reader:
            got = reader.readinto(out) if out.nbytes else 0
            extra = reader.read(1)  # finishes the frame: the checksum is verified here
    except zstd.ZstdError as exc:
        raise CorruptCheckpointError(f"zstd frame does not decode: {exc}") from exc
    if got != out.nbytes or extra:
        size = f"more than {out.nbytes}" if extra else str(got)
        raise CorruptCheckpointError(f"zstd frame decodes to {size} bytes, expected {out.nbytes}")


def zstd_decompress_slack(frame: Any, buf: np.ndarray) -> None:
    """Decode one zstd frame of ``buf.nbytes - 1`` bytes into ``buf`` (the last byte is slack).

    One ``readinto`` with a byte to spare decodes to the frame's end (checksum included, if any) and
    shows a frame that is too long; :func:`zstd_decompress_into`'s ``read(1)`` after filling exactly
    holds the GIL for 40-50 us per 4 MiB plane (zstd finishes the frame's last block in it).
    """
    expected = buf.nbytes - 1
    try:
        with _decompressor().stream_reader(frame, read_across_frames=False, closefd=False) as reader:
            got = reader.readinto(buf)
    except zstd.ZstdError as exc:
        raise CorruptCheckpointError(f"zstd frame does not decode: {exc}") from exc
    if got != expected:
        size = f"more than {expected}" if got > expected else str(got)
        raise CorruptCheckpointError(f"zstd frame decodes to {size} bytes, expected {expected}")


def copy_into(out: np.ndarray, data: Any) -> None:
    """``out[:] = data`` through NumPy, which releases the GIL (a memoryview copy holds it)."""
    if out.nbytes:
        out[:] = np.frombuffer(data, dtype=np.uint8)


__all__ = ["compressor", "copy_into", "scratch", "zstd_decompress_into", "zstd_decompress_slack"]
