"""Compress: codecs between the serializer and the storage file, chunked and multi-threaded.

Why a module of our own rather than one ``zstd`` call: a checkpoint is gigabytes that must leave the
process at storage speed. Single-call zstd runs on one core and gains only ~1.1x on float weights.
Here every file is cut into chunks (4 MiB by default) that a shared thread pool compresses in parallel;
python-zstandard, the native plane kernels and NumPy release the GIL, so training threads keep running. Compressed chunks are
written in order, with a bounded number in flight so memory stays bounded. Float tensors can go through
a byte-plane transform first (below), which is where the ratio comes from.

Codecs (``get_codec(name)``):

* ``"none"``: identity; the file is the native ``.pt``.
* ``"zstd"``: a standard zstd stream. ``zstd -d file.pt.zst`` gives the native bytes exactly, so users
  can decompress without checkpointd. One zstd frame per chunk (content size and checksum included),
  then a seek table in the *zstd seekable format* of zstd's ``contrib/seekable_format``: a skippable
  frame (magic ``0x184D2A5E``) with one ``<u32 compressed size, u32 decompressed size>`` entry per frame,
  ending in ``<u32 frame count><u8 descriptor = 0><u32 0x8F92EAB1>``. The zstd tool skips it; we use it
  to seek and to decode chunks in parallel.
* ``"zstd-planes"``: the float-aware, high-ratio option (ZipNN's idea). For tensor records whose dtype
  is a 2-, 4- or 8-byte float (or complex of those), each element is rotated left by one bit, so the
  exponent fills the top byte and the sign joins the mantissa, and then byte ``i`` of every element is
  grouped into plane ``i``. The exponent plane is low-entropy and is Huffman-coded (~3x;
  :mod:`checkpointd.codecs.huffman`, in independent blocks that a GPU decodes in parallel); mantissa
  planes are near random and are stored raw unless coding gains. Each chunk keeps whichever of planes,
  plain zstd or raw is smallest (judged on a 16 Ki-element sample). The container, byte by byte, is in
  ``docs/format.md``: a banner frame, one skippable frame per chunk (kind raw, zstd or planes; a planes
  chunk holds a plane table, the planes and the native tail, and a CRC-32 of every stored byte), then
  the seek table with footer magic ``0x31504B43`` (``b"CKP1"``).

Why this shape: every data chunk sits in a skippable frame, so ``zstd -d`` on a planes file succeeds but
writes only the banner text; it can never produce plausible but wrong tensor bytes. ``torch.load`` of
that output fails at once, and ``cat`` of it says what to do. The index lets ``open_decoded(...)``
seek to one tensor and decode only the chunks it spans.

Integrity: every chunk verifies on its own (CRC-32 of its stored planes or zstd frame checksums, sizes),
so a partial read of one tensor still detects damage. Limits: an ``open_decoded`` stream is for one
thread at a time; encoders must not be driven from a thread of the codec's own pool (they wait on it).
"""

from __future__ import annotations

import io
import os
import threading
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any, Protocol, cast

import numpy as np
import torch
import zstandard as zstd

from checkpointd.codecs.chunked import DIRECT_MIN_BYTES, ChunkedEncoder, WriteSink, write_all
from checkpointd.codecs.container import PLANES_FOOTER_MAGIC, SEEKABLE_FOOTER_MAGIC
from checkpointd.codecs.planes import banner_frame, decode_chunk_into, encode_chunk
from checkpointd.codecs.plane_kernels import UINT_BY_ITEMSIZE
from checkpointd.codecs.reader import DecodedReader
from checkpointd.codecs.zstd_frames import compressor, zstd_decompress_into
from checkpointd.errors import ConfigError, CorruptCheckpointError
from checkpointd.format import layout
from checkpointd.format.manifest import CODECS
from checkpointd.format.streams import ReadStream

DEFAULT_CHUNK_BYTES = 4 << 20
"""Chunk size: large enough that per-chunk Python overhead is noise, small enough to stay in cache."""
PLANES_CHUNK_BYTES = 16 << 20
"""``zstd-planes`` chunks are bigger: a chunk's steps in Python (choosing its planes, its CRC, its
frame; on restore, checking its layout) are paid per chunk on both sides, and a chunk holds a
Huffman code per coded plane. A one-tensor partial read decodes at most one chunk more on each side."""

_MAX_CHUNK_BYTES = 1 << 30
_MIN_LEVEL = -(1 << 17)  # ZSTD_minCLevel(); python-zstandard exports only the maximum

class Encoder(Protocol):
    """Streaming side of a codec; see :meth:`Codec.encoder`."""

    dtype_hint: torch.dtype | None

    def write(self, data: Any, /) -> int: ...

    def close(self) -> None: ...


class Codec(Protocol):
    """A file codec: the name goes in the manifest, the suffix on file names."""

    name: str
    suffix: str

    def encoder(self, out: WriteSink) -> Encoder: ...

    def open_decoded(self, raw: ReadStream) -> ReadStream: ...


# -- thread pool ----------------------------------------------------------------------------------------

_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def default_executor() -> ThreadPoolExecutor:
    """The module's shared compression pool, created on first use (``min(32, cpu_count)`` threads; in a
    forked child, again: the parent's threads are not there)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=min(32, os.cpu_count() or 1), thread_name_prefix="checkpointd-zstd")
        return _pool


def _forget_pool_in_child() -> None:
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_in_child)


# -- codecs -----------------------------------------------------------------------------------------


class _PassthroughEncoder:
    """Identity encoder: writes go straight to ``out``."""

    def __init__(self, out: WriteSink) -> None:
        self._out = out
        self.dtype_hint: torch.dtype | None = None

    def write(self, data: Any, /) -> int:
        view = memoryview(data).cast("B")
        write_all(self._out, view)
        return view.nbytes

    def close(self) -> None:
        pass


class NoCodec:
    """The identity codec: files are native ``.pt``/``.mdlus`` files."""

    name = "none"
    suffix = ""

    def encoder(self, out: WriteSink) -> Encoder:
        return _PassthroughEncoder(out)

    def open_decoded(self, raw: ReadStream) -> ReadStream:
        return raw

    def __repr__(self) -> str:
        return "NoCodec()"


class ZstdCodec:
    """Chunked, parallel zstd whose output the ``zstd`` command line decodes to the native file.

    Args:
        level: zstd level for chunks (1 by default: ~1 GB/s per core on floats, nearly the ratio of 3).
        chunk_bytes: native bytes per chunk (64 KiB to 1 GiB).
        executor: pool that compresses and decompresses chunks; the module's shared pool by default.
        max_inflight: chunks submitted but not yet written, per encoder (bounds memory); by default
            twice the pool's threads.

    Raises:
        ConfigError: a level or chunk size out of range.
    """

    name = "zstd"
    suffix = layout.ZSTD_SUFFIX
    footer_magic = SEEKABLE_FOOTER_MAGIC
    """The seek table's footer magic (:mod:`checkpointd.codecs.container`)."""

    def __init__(
        self,
        level: int = 1,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        executor: Executor | None = None,
        max_inflight: int | None = None,
    ) -> None:
        if not _MIN_LEVEL <= level <= zstd.MAX_COMPRESSION_LEVEL:
            raise ConfigError(
                f"zstd level must be in [{_MIN_LEVEL}, {zstd.MAX_COMPRESSION_LEVEL}], got {level}"
            )
        if not DIRECT_MIN_BYTES <= chunk_bytes <= _MAX_CHUNK_BYTES:
            raise ConfigError(f"chunk_bytes must be in [{DIRECT_MIN_BYTES}, {_MAX_CHUNK_BYTES}], got {chunk_bytes}")
        if max_inflight is not None and max_inflight < 1:
            raise ConfigError(f"max_inflight must be >= 1, got {max_inflight}")
        self.level = level
        self.chunk_bytes = chunk_bytes
        self._executor = executor
        self._max_inflight = max_inflight

    @property
    def executor(self) -> Executor:
        return self._executor or default_executor()

    @property
    def max_inflight(self) -> int:
        workers = getattr(self.executor, "_max_workers", os.cpu_count() or 1)
        return self._max_inflight or 2 * workers

    def encoder(self, out: WriteSink) -> Encoder:
        """A streaming encoder into ``out``; ``close()`` writes the rest and the seek table.

        Buffers of ``DIRECT_MIN_BYTES`` or more are compressed in place (zero-copy): the caller keeps
        them unchanged until ``close()`` returns, as staged checkpoint buffers are.
        """
        return ChunkedEncoder(self._encode, out, chunk_bytes=self.chunk_bytes, executor=self.executor,
                              max_inflight=self.max_inflight, footer_magic=self.footer_magic, preamble=self._preamble())

    def open_decoded(self, raw: ReadStream) -> ReadStream:
        """A seekable stream of the native bytes of ``raw``; closing it closes ``raw``.

        Raises:
            CorruptCheckpointError: no valid seek table (truncated or not written by checkpointd).
        """
        return DecodedReader(self, raw)

    # hooks of the chunked encoder and decoder, overridden by the planes codec
    def _preamble(self) -> list[bytes]:
        return []

    def _encode(self, view: memoryview, dtype: torch.dtype | None) -> list[Any]:
        return [compressor(self.level).compress(view)]

    def decode_into(self, frame: memoryview, out: np.ndarray) -> None:
        """Decode one chunk frame into ``out`` (uint8, the chunk's native size); runs on the pool."""
        zstd_decompress_into(frame, out)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(level={self.level}, chunk_bytes={self.chunk_bytes})"


class ZstdPlanesCodec(ZstdCodec):
    """Float-aware zstd: byte planes for float records; a container only checkpointd decodes.

    Same arguments as :class:`ZstdCodec`; ``level`` applies to chunks compressed without planes.
    """

    name = "zstd-planes"
    footer_magic = PLANES_FOOTER_MAGIC

    def __init__(self, level: int = 1, *, chunk_bytes: int = PLANES_CHUNK_BYTES, **options: Any) -> None:
        super().__init__(level, chunk_bytes=chunk_bytes, **options)

    def _preamble(self) -> list[bytes]:
        return [banner_frame()]

    def _encode(self, view: memoryview, dtype: torch.dtype | None) -> list[Any]:
        return encode_chunk(view, plane_itemsize(dtype), self.level)

    def decode_into(self, frame: memoryview, out: np.ndarray) -> None:
        decode_chunk_into(frame, out)


def plane_itemsize(dtype: torch.dtype | None) -> int:
    """Element size to cut planes at, or 0 for data that planes do not help (ints, bool, float8)."""
    if dtype is None:
        return 0
    if dtype.is_complex:
        dtype = dtype.to_real()
    return dtype.itemsize if dtype.is_floating_point and dtype.itemsize in UINT_BY_ITEMSIZE else 0


_CODECS: dict[str, Callable[..., Codec]] = {"none": NoCodec, "zstd": ZstdCodec, "zstd-planes": ZstdPlanesCodec}
assert set(_CODECS) == set(CODECS), "a codec a manifest may name is missing, or one is not in manifest.CODECS"


def get_codec(name: str | None, **options: Any) -> Codec:
    """The codec called ``name`` (``None`` means ``"none"``); ``options`` go to its constructor.

    Raises:
        ConfigError: an unknown name, or options the codec rejects.
    """
    key = "none" if name is None else name
    factory = _CODECS.get(key)
    if factory is None:
        choices = ", ".join(repr(n) for n in _CODECS)
        raise ConfigError(f"unknown compression codec {name!r}; choose one of None, {choices}")
    if key == "none":
        return factory()
    return factory(**options)


def decode_bytes(name: str, data: Any) -> bytes | bytearray:
    """The native bytes of a whole encoded file held in memory (any bytes-like object).

    Chunks decode in parallel on the pool, each straight into its place in the result, which is a
    ``bytearray`` for compressed codecs (a ``bytes`` copy would be one more single-threaded pass).
    """
    codec = get_codec(name)
    if codec.name == "none":
        return bytes(data)
    source = memoryview(data).cast("B")
    with DecodedReader(cast(ZstdCodec, codec), io.BytesIO(b""), source) as stream:  # every codec but "none" is one
        out = bytearray(stream.seek(0, io.SEEK_END))
        stream.seek(0)
        if out and stream.readinto(out) != len(out):
            raise CorruptCheckpointError(f"{codec.name!r} stream ended early")
    return out


__all__ = [
    "Codec",
    "Encoder",
    "NoCodec",
    "WriteSink",
    "ZstdCodec",
    "ZstdPlanesCodec",
    "decode_bytes",
    "default_executor",
    "get_codec",
    "plane_itemsize",
]
