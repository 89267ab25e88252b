"""The persist process's encoder: a compressed file's native bytes encoded and written there.

Loaded by path by :mod:`checkpointd.storage.persist_process_main`, which imports nothing of the package;
the codecs are imported here on the first ``encode`` request, with the package as a bare namespace (its
``__init__`` imports torch, the codec modules do not): :mod:`checkpointd.codecs.chunked` cuts the stream
into chunks and writes their frames in order, :mod:`checkpointd.codecs.planes` and
:mod:`checkpointd.codecs.zstd_frames` encode them, on the process's pool.
"""

from __future__ import annotations

import importlib
import os
import sys
import types
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def encode_file(fd: int, codec: str, level: int, chunk_bytes: int, pieces: list, slabs: dict[int, Any],
                pool: ThreadPoolExecutor, crc32: Callable[..., int], pwrite_all: Callable[[int, Any, int], None]) -> list[int]:
    """Encode the native file ``pieces`` (inline ``(0, bytes, hint)``, ranges of ``slabs`` ``(1, slab_id, start,
    length, hint)``) with ``codec`` into ``fd`` from offset 0, cut to its end; ``[size, CRC-32, native size]``."""
    encode, preamble, footer_magic = _encoding(codec, level)
    out = _FileSink(fd, crc32, pwrite_all)
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
        encoder.dtype_hint = hint
        encoder.write(view)
    encoder.close()
    os.ftruncate(fd, out.offset)
    return [out.offset, out.crc, encoder.native_nbytes]


class _FileSink:
    """Encoded bytes into a file front to back with ``pwrite``, their CRC-32 kept as they pass."""

    def __init__(self, fd: int, crc32: Callable[..., int], pwrite_all: Callable[[int, Any, int], None]) -> None:
        self.fd, self._crc32, self._pwrite_all = fd, crc32, pwrite_all
        self.offset = 0
        self.crc = 0

    def write(self, data: memoryview) -> int:
        self._pwrite_all(self.fd, data, self.offset)
        self.crc = self._crc32(data, self.crc)
        self.offset += data.nbytes
        return data.nbytes


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
