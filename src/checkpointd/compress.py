"""Compress: codecs between the serializer and the storage file, chunked and multi-threaded.

Why a module of our own rather than one ``zstd`` call: a checkpoint is gigabytes that must leave the
process at storage speed. Single-call zstd runs on one core and gains only ~1.1x on float weights.
Here every file is cut into chunks (4 MiB by default) that a shared thread pool compresses in parallel;
python-zstandard and NumPy release the GIL, so training threads keep running. Compressed chunks are
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
  grouped into plane ``i``. The exponent plane is low-entropy and compresses ~3x with zstd tuned for
  literals (few matches); mantissa planes are near random and are stored raw unless zstd gains. Each
  chunk keeps whichever of planes, plain zstd or raw is smallest (judged on a 16 Ki-element sample).

``zstd-planes`` container (all integers little-endian)::

    banner      a regular zstd frame whose content is a short text saying "decode with checkpointd"
    chunk * N   skippable frame: <u32 0x184D2A53><u32 payload size> payload, where payload is
                <u8 kind><u8 itemsize><u8 flags><u8 0><u64 native size><u32 crc> and then
                kind 0 (raw):    the native bytes
                kind 1 (zstd):   one zstd frame of the native bytes
                kind 2 (planes): itemsize * <u8 mode (0 raw, 1 zstd)><3 x 0><u32 size>, the plane
                                 payloads, then the native tail (native size % itemsize bytes) raw;
                                 flags bit 0: elements were rotated left by one bit
                crc: CRC-32 of the bytes stored raw, in order (zstd parts carry their own checksum)
    index       the seek table above, with footer magic 0x31504B43 (b"CKP1") instead of 0x8F92EAB1;
                one entry per frame before it, the banner included (native size 0)

Why this shape: every data chunk sits in a skippable frame, so ``zstd -d`` on a planes file succeeds but
writes only the banner text; it can never produce plausible but wrong tensor bytes. ``torch.load`` of
that output fails at once, and ``cat`` of it says what to do. The index lets ``open_decoded(...)``
seek to one tensor and decode only the chunks it spans.

Integrity: every chunk verifies on its own (zstd frame checksums, CRC-32 of raw-stored parts, sizes),
so a partial read of one tensor still detects damage. Limits: an ``open_decoded`` stream is for one
thread at a time; encoders must not be driven from a thread of the codec's own pool (they wait on it).
"""

from __future__ import annotations

import bisect
import io
import os
import struct
import threading
import zlib
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any, BinaryIO, Protocol

import numpy as np
import torch
import zstandard as zstd

from . import layout
from .errors import ConfigError, CorruptCheckpointError

DEFAULT_CHUNK_BYTES = 4 << 20
"""Chunk size: large enough that per-chunk Python overhead is noise, small enough to stay in cache."""

DIRECT_MIN_BYTES = 64 << 10
"""Writes at least this big are chunked zero-copy; smaller ones are copied into a shared chunk."""

_MAX_CHUNK_BYTES = 1 << 30
_MIN_LEVEL = -(1 << 17)  # ZSTD_minCLevel(); python-zstandard exports only the maximum
_SAMPLE_ELEMENTS = 16 << 10
_SAMPLE_SLICES = 4
_RANDOM_ENTROPY_BITS = 7.95
"""A sample plane above this (uniform bytes measure ~7.99 on 16 Ki samples) is stored raw untried."""

_SKIPPABLE_INDEX_MAGIC = 0x184D2A5E
_SKIPPABLE_CHUNK_MAGIC = 0x184D2A53
_SEEKABLE_FOOTER_MAGIC = 0x8F92EAB1
_PLANES_FOOTER_MAGIC = 0x31504B43

_FRAME_HEADER = struct.Struct("<II")  # skippable frame: magic, payload size
_ENTRY = struct.Struct("<II")  # seek table entry: frame size, native size
_FOOTER = struct.Struct("<IBI")  # frame count, descriptor, magic
_CHUNK_HEADER = struct.Struct("<BBBxQI")  # kind, itemsize, flags, native size, CRC-32 of raw-stored bytes
_PLANE = struct.Struct("<BxxxI")  # mode, stored size

_KIND_RAW, _KIND_ZSTD, _KIND_PLANES = 0, 1, 2
_FLAG_ROTATED = 1
_UINT_BY_ITEMSIZE = {2: np.uint16, 4: np.uint32, 8: np.uint64}

PLANES_BANNER = (
    b"checkpointd: this file was compressed with codec 'zstd-planes', which the zstd tool cannot\n"
    b"decode (its data sits in skippable frames). Restore native files with:\n"
    b"    checkpointd export STEP_DIR OUT_DIR\n"
)
"""What ``zstd -d`` prints into the output of a planes file: loud, and says what to do."""


class WriteSink(Protocol):
    """Where encoded bytes go (a checksumming file wrapper in the writer)."""

    def write(self, data: memoryview, /) -> Any: ...


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

    def open_decoded(self, raw: BinaryIO) -> BinaryIO: ...


# -- thread pool and per-thread zstd contexts ---------------------------------------------------------

_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_local = threading.local()


def default_executor() -> ThreadPoolExecutor:
    """The module's shared compression pool, created on first use (``min(32, cpu_count)`` threads)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=min(32, os.cpu_count() or 1), thread_name_prefix="checkpointd-zstd")
        return _pool


def _compressor(level: int) -> zstd.ZstdCompressor:
    """This thread's compressor for ``level`` (zstd contexts are not thread-safe, and costly to make)."""
    cache = _local.__dict__.setdefault("compressors", {})
    if level not in cache:
        cache[level] = zstd.ZstdCompressor(level=level, write_checksum=True)
    return cache[level]


def _plane_compressor() -> zstd.ZstdCompressor:
    """This thread's compressor for byte planes: Huffman literals, almost no matches.

    Exponent planes hold ~2.5 bits of entropy per byte spread evenly, so short LZ matches abound and
    cost more than they save; level 1 reaches 2.8x at 0.3 GB/s, these parameters 3.05x at 0.8 GB/s.
    """
    comp = getattr(_local, "plane_compressor", None)
    if comp is None:
        params = zstd.ZstdCompressionParameters(
            strategy=zstd.STRATEGY_FAST, window_log=17, hash_log=6, chain_log=6, search_log=1,
            min_match=7, target_length=0, write_checksum=True,
        )  # fmt: skip
        comp = _local.plane_compressor = zstd.ZstdCompressor(compression_params=params)
    return comp


def _decompressor() -> zstd.ZstdDecompressor:
    dctx = getattr(_local, "decompressor", None)
    if dctx is None:
        dctx = _local.decompressor = zstd.ZstdDecompressor()
    return dctx


# -- codecs -----------------------------------------------------------------------------------------


class _PassthroughEncoder:
    """Identity encoder: writes go straight to ``out``."""

    def __init__(self, out: WriteSink) -> None:
        self._out = out
        self.dtype_hint: torch.dtype | None = None

    def write(self, data: Any, /) -> int:
        view = memoryview(data).cast("B")
        _write_all(self._out, view)
        return view.nbytes

    def close(self) -> None:
        pass


class NoCodec:
    """The identity codec: files are native ``.pt``/``.mdlus`` files."""

    name = "none"
    suffix = ""

    def encoder(self, out: WriteSink) -> Encoder:
        return _PassthroughEncoder(out)

    def open_decoded(self, raw: BinaryIO) -> BinaryIO:
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
    _footer_magic = _SEEKABLE_FOOTER_MAGIC

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
        return _ChunkedEncoder(self, out)

    def open_decoded(self, raw: BinaryIO) -> BinaryIO:
        """A seekable stream of the native bytes of ``raw``; closing it closes ``raw``.

        Raises:
            CorruptCheckpointError: no valid seek table (truncated or not written by checkpointd).
        """
        return _DecodedReader(self, raw)

    # hooks of the chunked encoder and decoder, overridden by the planes codec
    def _preamble(self) -> list[bytes]:
        return []

    def _encode(self, view: memoryview, dtype: torch.dtype | None) -> list[Any]:
        return [_compressor(self.level).compress(view)]

    def _decode(self, frame: memoryview, native_nbytes: int) -> Any:
        return _zstd_decompress(frame, native_nbytes)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(level={self.level}, chunk_bytes={self.chunk_bytes})"


class ZstdPlanesCodec(ZstdCodec):
    """Float-aware zstd: byte planes for float records; a container only checkpointd decodes.

    Same arguments as :class:`ZstdCodec`; ``level`` applies to chunks compressed without planes.
    """

    name = "zstd-planes"
    _footer_magic = _PLANES_FOOTER_MAGIC

    def _preamble(self) -> list[bytes]:
        return [_banner_frame()]

    def _encode(self, view: memoryview, dtype: torch.dtype | None) -> list[Any]:
        itemsize = _plane_itemsize(dtype)
        parts: list[Any] | None = None
        worth = _choose_planes(view, itemsize, self.level) if itemsize and view.nbytes >= itemsize else None
        if worth is not None:
            parts = _encode_planes(view, itemsize, worth)
        if parts is None:
            packed = _compressor(self.level).compress(view)
            if len(packed) < view.nbytes:
                parts = [_CHUNK_HEADER.pack(_KIND_ZSTD, 1, 0, view.nbytes, 0), packed]
            else:
                parts = [_CHUNK_HEADER.pack(_KIND_RAW, 1, 0, view.nbytes, zlib.crc32(view)), view]
        payload_nbytes = sum(memoryview(p).nbytes for p in parts)
        return [_FRAME_HEADER.pack(_SKIPPABLE_CHUNK_MAGIC, payload_nbytes), *parts]

    def _decode(self, frame: memoryview, native_nbytes: int) -> Any:
        if frame.nbytes < _FRAME_HEADER.size + _CHUNK_HEADER.size:
            raise CorruptCheckpointError(f"chunk frame of {frame.nbytes} bytes is too short")
        magic, payload_nbytes = _FRAME_HEADER.unpack_from(frame)
        if magic != _SKIPPABLE_CHUNK_MAGIC or payload_nbytes != frame.nbytes - _FRAME_HEADER.size:
            raise CorruptCheckpointError(f"bad chunk frame header (magic {magic:#x}, size {payload_nbytes})")
        kind, itemsize, flags, size, crc = _CHUNK_HEADER.unpack_from(frame, _FRAME_HEADER.size)
        if size != native_nbytes:
            raise CorruptCheckpointError(f"chunk says {size} native bytes, the index {native_nbytes}")
        body = frame[_FRAME_HEADER.size + _CHUNK_HEADER.size :]
        if kind == _KIND_RAW and body.nbytes == size:
            return _check_crc(body, zlib.crc32(body), crc)
        if kind == _KIND_ZSTD:
            return _zstd_decompress(body, size)
        if kind == _KIND_PLANES and itemsize in _UINT_BY_ITEMSIZE:
            return _decode_planes(body, itemsize, flags, size, crc)
        raise CorruptCheckpointError(f"bad chunk header (kind {kind}, itemsize {itemsize}, {body.nbytes} bytes)")


_CODECS: dict[str, Callable[..., Codec]] = {"none": NoCodec, "zstd": ZstdCodec, "zstd-planes": ZstdPlanesCodec}


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


def decode_bytes(name: str, data: bytes) -> bytes:
    """The native bytes of a whole encoded file held in memory (decoded in parallel)."""
    codec = get_codec(name)
    if codec.name == "none":
        return bytes(data)
    with codec.open_decoded(io.BytesIO(data)) as stream:
        return stream.read()


# -- encoding ---------------------------------------------------------------------------------------


class _ChunkedEncoder:
    """Cuts a write stream into chunks, compresses them on the pool, writes frames in order.

    Called from one thread (the file's writer task). Small writes (zip headers, small tensors) are
    copied into a pending chunk; large ones are cut zero-copy at element-aligned boundaries and carry
    the current ``dtype_hint``. At most ``codec.max_inflight`` chunks wait at once.
    """

    def __init__(self, codec: ZstdCodec, out: WriteSink) -> None:
        self._codec = codec
        self._out = out
        self._executor = codec.executor
        self._inflight: deque[tuple[Future[list[Any]], int]] = deque()
        self._pending = bytearray()
        self._entries: list[tuple[int, int]] = []
        self._closed = False
        self.dtype_hint: torch.dtype | None = None
        for frame in codec._preamble():
            self._emit([frame], 0)

    def write(self, data: Any, /) -> int:
        if self._closed:
            raise ValueError("write to a closed encoder")
        view = memoryview(data).cast("B")
        if view.nbytes < DIRECT_MIN_BYTES:
            self._pending += view
            if len(self._pending) >= self._codec.chunk_bytes:
                self._flush_pending()
            return view.nbytes
        self._flush_pending()
        for piece in _split(view, self._codec.chunk_bytes):
            self._submit(piece, self.dtype_hint)
        return view.nbytes

    def close(self) -> None:
        """Write every remaining frame and the seek table; ``out`` stays open."""
        if self._closed:
            return
        self._flush_pending()
        while self._inflight:
            self._drain_one()
        self._closed = True
        _write_all(self._out, memoryview(_seek_table(self._entries, self._codec._footer_magic)))

    def _flush_pending(self) -> None:
        if self._pending:
            chunk, self._pending = self._pending, bytearray()
            self._submit(memoryview(chunk), None)

    def _submit(self, piece: memoryview, dtype: torch.dtype | None) -> None:
        future = self._executor.submit(self._codec._encode, piece, dtype)
        self._inflight.append((future, piece.nbytes))
        while self._inflight and (len(self._inflight) > self._codec.max_inflight or self._inflight[0][0].done()):
            self._drain_one()

    def _drain_one(self) -> None:
        future, native_nbytes = self._inflight.popleft()
        self._emit(future.result(), native_nbytes)

    def _emit(self, parts: list[Any], native_nbytes: int) -> None:
        frame_nbytes = 0
        for part in parts:
            view = memoryview(part).cast("B")
            _write_all(self._out, view)
            frame_nbytes += view.nbytes
        self._entries.append((frame_nbytes, native_nbytes))


def _split(view: memoryview, chunk_bytes: int) -> Iterable[memoryview]:
    """Near-equal pieces of at most ~``chunk_bytes``, cut at multiples of 16 (any element size)."""
    count = -(-view.nbytes // chunk_bytes)
    step = -(-view.nbytes // (count * 16)) * 16 if count > 1 else view.nbytes
    return (view[start : start + step] for start in range(0, view.nbytes, step))


def _seek_table(entries: list[tuple[int, int]], footer_magic: int) -> bytes:
    body = b"".join(_ENTRY.pack(*e) for e in entries) + _FOOTER.pack(len(entries), 0, footer_magic)
    return _FRAME_HEADER.pack(_SKIPPABLE_INDEX_MAGIC, len(body)) + body


def _banner_frame() -> bytes:
    return zstd.ZstdCompressor(level=1, write_checksum=True).compress(PLANES_BANNER)


def _plane_itemsize(dtype: torch.dtype | None) -> int:
    """Element size to cut planes at, or 0 for data that planes do not help (ints, bool, float8)."""
    if dtype is None:
        return 0
    if dtype.is_complex:
        dtype = dtype.to_real()
    return dtype.itemsize if dtype.is_floating_point and dtype.itemsize in _UINT_BY_ITEMSIZE else 0


def _to_planes(view: memoryview, itemsize: int) -> np.ndarray:
    """(itemsize, n) planes of the rotated elements in ``view`` (whole elements only)."""
    bits = itemsize * 8
    elems = np.frombuffer(view, dtype=_UINT_BY_ITEMSIZE[itemsize], count=view.nbytes // itemsize)
    rotated = np.left_shift(elems, 1)
    rotated |= elems >> (bits - 1)
    return rotated.view(np.uint8).reshape(-1, itemsize).T.copy()


def _choose_planes(view: memoryview, itemsize: int, level: int) -> list[bool] | None:
    """Judge a sample of elements from a few places across the chunk (tensors are not uniform).

    Returns ``None`` if plain zstd beats planes (zeros, integer-valued floats), else which planes are
    worth a zstd attempt: all but those whose byte entropy looks uniform. Entropy, not a trial
    compression, decides that: on a small sample zstd's table overhead hides the 2-9% that skewed
    mantissa planes gain on a whole chunk.
    """
    count = view.nbytes // itemsize
    if count < _SAMPLE_ELEMENTS:
        return [True] * itemsize
    per_slice = _SAMPLE_ELEMENTS // _SAMPLE_SLICES
    starts = [(count - per_slice) * i // (_SAMPLE_SLICES - 1) * itemsize for i in range(_SAMPLE_SLICES)]
    sample = memoryview(b"".join(view[s : s + per_slice * itemsize] for s in starts))
    planes = _to_planes(sample, itemsize)
    worth = [_entropy_bits(p) < _RANDOM_ENTROPY_BITS for p in planes]
    packed = sum(len(_plane_compressor().compress(p)) if w else p.nbytes for p, w in zip(planes, worth))
    if len(_compressor(level).compress(sample)) < 0.95 * packed:
        return None
    return worth


def _entropy_bits(plane: np.ndarray) -> float:
    """Shannon entropy of the byte histogram, in bits per byte."""
    freq = np.bincount(plane, minlength=256)
    freq = freq[freq > 0] / plane.size
    return float(-(freq * np.log2(freq)).sum())


def _encode_planes(view: memoryview, itemsize: int, worth: list[bool]) -> list[Any]:
    """Chunk payload parts of kind planes: header, plane table, planes, native tail."""
    whole = view.nbytes // itemsize * itemsize
    planes = _to_planes(view[:whole], itemsize)
    table, blobs, crc = [], [], 0
    for plane, compress in zip(planes, worth):
        packed = _plane_compressor().compress(plane) if compress else None
        if packed is not None and len(packed) < plane.nbytes:
            table.append(_PLANE.pack(1, len(packed)))
            blobs.append(packed)
        else:
            table.append(_PLANE.pack(0, plane.nbytes))
            blobs.append(plane)
            crc = zlib.crc32(plane, crc)
    crc = zlib.crc32(view[whole:], crc)
    header = _CHUNK_HEADER.pack(_KIND_PLANES, itemsize, _FLAG_ROTATED, view.nbytes, crc) + b"".join(table)
    return [header, *blobs, view[whole:]]


# -- decoding ---------------------------------------------------------------------------------------


def _zstd_decompress(frame: memoryview, native_nbytes: int) -> bytes:
    try:
        data = _decompressor().decompress(frame, max_output_size=native_nbytes)
    except zstd.ZstdError as exc:
        raise CorruptCheckpointError(f"zstd frame does not decode: {exc}") from exc
    if len(data) != native_nbytes:
        raise CorruptCheckpointError(f"zstd frame decodes to {len(data)} bytes, expected {native_nbytes}")
    return data


def _decode_planes(body: memoryview, itemsize: int, flags: int, native_nbytes: int, crc: int) -> np.ndarray:
    """Native bytes of a planes chunk: decode each plane into its byte column, rotate back."""
    count = native_nbytes // itemsize
    out = np.empty(native_nbytes, dtype=np.uint8)
    columns = out[: count * itemsize].reshape(count, itemsize)
    pos, actual_crc = _PLANE.size * itemsize, 0
    for i in range(itemsize):
        mode, stored = _PLANE.unpack_from(body, _PLANE.size * i)
        blob = body[pos : pos + stored]
        pos += stored
        if mode == 1:
            blob = memoryview(_zstd_decompress(blob, count))
        elif mode == 0 and blob.nbytes == count:
            actual_crc = zlib.crc32(blob, actual_crc)
        else:
            raise CorruptCheckpointError(f"bad plane {i} (mode {mode}, {blob.nbytes} of {count} bytes)")
        columns[:, i] = np.frombuffer(blob, dtype=np.uint8)  # one strided pass per plane: ~8x faster than .T
    tail = body[pos:]
    if tail.nbytes != native_nbytes - count * itemsize:
        raise CorruptCheckpointError(f"planes chunk has {tail.nbytes} tail bytes, expected {native_nbytes % itemsize}")
    _check_crc(tail, zlib.crc32(tail, actual_crc), crc)
    out[count * itemsize :] = np.frombuffer(tail, dtype=np.uint8)
    if flags & _FLAG_ROTATED:
        elems = out[: count * itemsize].view(_UINT_BY_ITEMSIZE[itemsize])
        low = elems >> 1
        elems <<= itemsize * 8 - 1
        elems |= low
    return out


def _check_crc(data: Any, actual: int, expected: int) -> Any:
    if actual != expected:
        raise CorruptCheckpointError(f"CRC-32 of raw-stored bytes is {actual:#010x}, the chunk says {expected:#010x}")
    return data


def _read_index(raw: BinaryIO, footer_magic: int, codec_name: str) -> tuple[list[int], list[int]]:
    """Frame offsets and native offsets (each with a final end offset) from the trailing seek table."""
    end = raw.seek(0, io.SEEK_END)
    hint = f"the {codec_name!r} file is truncated, corrupt, or was not written by checkpointd"
    if end < _FRAME_HEADER.size + _FOOTER.size:
        raise CorruptCheckpointError(f"{hint}: {end} bytes is too short for a seek table")
    raw.seek(end - _FOOTER.size)
    count, descriptor, magic = _FOOTER.unpack(_read_exact(raw, _FOOTER.size, hint))
    if magic != footer_magic or descriptor & 0x7F:
        raise CorruptCheckpointError(f"{hint}: no seek table at the end (magic {magic:#x})")
    entry_size = _ENTRY.size + (4 if descriptor & 0x80 else 0)  # bit 7: per-frame checksums follow
    table_nbytes = _FRAME_HEADER.size + count * entry_size + _FOOTER.size
    if table_nbytes > end:
        raise CorruptCheckpointError(f"{hint}: seek table of {count} frames exceeds the file")
    raw.seek(end - table_nbytes)
    table = memoryview(_read_exact(raw, table_nbytes - _FOOTER.size, hint))
    frame_magic, body_nbytes = _FRAME_HEADER.unpack_from(table)
    if frame_magic != _SKIPPABLE_INDEX_MAGIC or body_nbytes != table_nbytes - _FRAME_HEADER.size:
        raise CorruptCheckpointError(f"{hint}: bad seek table frame header")
    frame_offsets, native_offsets = [0], [0]
    for i in range(count):
        frame_nbytes, native_nbytes = _ENTRY.unpack_from(table, _FRAME_HEADER.size + i * entry_size)
        frame_offsets.append(frame_offsets[-1] + frame_nbytes)
        native_offsets.append(native_offsets[-1] + native_nbytes)
    if frame_offsets[-1] != end - table_nbytes:
        raise CorruptCheckpointError(f"{hint}: frames span {frame_offsets[-1]} bytes, the file {end - table_nbytes}")
    return frame_offsets, native_offsets


def _read_exact(raw: BinaryIO, nbytes: int, hint: str) -> bytes:
    data = raw.read(nbytes)
    if data is None or len(data) != nbytes:
        raise CorruptCheckpointError(f"{hint}: short read ({0 if data is None else len(data)} of {nbytes} bytes)")
    return data


class _DecodedReader(io.RawIOBase):
    """Seekable stream of a chunked file's native bytes, decoding chunks on the pool.

    Reads of ``raw`` happen on the calling thread only (fsspec files are not thread-safe); the pool
    only decodes. A read decodes the chunks it spans, up to ``max_inflight`` at once in parallel, and
    nothing else, so one tensor of a large file loads without decoding the rest.
    """

    def __init__(self, codec: ZstdCodec, raw: BinaryIO) -> None:
        super().__init__()
        if not (raw.seekable() if hasattr(raw, "seekable") else False):
            raw = io.BytesIO(raw.read())
        self._codec = codec
        self._raw = raw
        self._frames, self._natives = _read_index(raw, codec._footer_magic, codec.name)
        self._size = self._natives[-1]
        self._pos = 0
        self._futures: dict[int, Future[Any]] = {}
        self._cached: tuple[int, memoryview] | None = None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer: Any) -> int:
        dest = memoryview(buffer).cast("B")
        stop = min(self._size, self._pos + dest.nbytes)
        done = 0
        while self._pos < stop:
            index = bisect.bisect_right(self._natives, self._pos) - 1
            chunk = self._chunk(index, stop)
            start = self._pos - self._natives[index]
            count = min(stop - self._pos, chunk.nbytes - start)
            dest[done : done + count] = chunk[start : start + count]
            done += count
            self._pos += count
        return done

    def readall(self) -> bytes:
        # One join instead of bytearray + bytes(): first touch of fresh pages is the cost here.
        pieces = []
        while self._pos < self._size:
            index = bisect.bisect_right(self._natives, self._pos) - 1
            chunk = self._chunk(index, self._size)
            pieces.append(chunk[self._pos - self._natives[index] :])
            self._pos = self._natives[index + 1]
        return b"".join(pieces)

    def close(self) -> None:
        if not self.closed:
            for future in self._futures.values():
                future.cancel()
            self._futures.clear()
            self._cached = None
            self._raw.close()
        super().close()

    def _chunk(self, index: int, stop: int) -> memoryview:
        """Decoded chunk ``index``, submitting the chunks up to native offset ``stop`` (bounded) too."""
        if self._cached is not None and self._cached[0] == index:
            return self._cached[1]
        for stale in [i for i in self._futures if i < index]:
            self._futures.pop(stale).cancel()
        last = bisect.bisect_left(self._natives, stop) - 1
        for i in range(index, min(last, index + self._codec.max_inflight - 1) + 1):
            if i not in self._futures:
                self._futures[i] = self._submit(i)
        data = memoryview(self._futures.pop(index).result()).cast("B")
        self._cached = (index, data)
        return data

    def _submit(self, index: int) -> Future[Any]:
        start, stop = self._frames[index], self._frames[index + 1]
        self._raw.seek(start)
        frame = _read_exact(self._raw, stop - start, f"chunk {index} of the {self._codec.name!r} file")
        native_nbytes = self._natives[index + 1] - self._natives[index]
        return self._codec.executor.submit(self._decode_chunk, index, frame, native_nbytes)

    def _decode_chunk(self, index: int, frame: bytes, native_nbytes: int) -> Any:
        try:
            return self._codec._decode(memoryview(frame), native_nbytes)
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(
                f"{self._codec.name!r} chunk {index} (file bytes {self._frames[index]}..{self._frames[index + 1]}): "
                f"{exc}; the file is corrupt, restore another step"
            ) from exc
        except (struct.error, ValueError) as exc:
            raise CorruptCheckpointError(f"{self._codec.name!r} chunk {index} is malformed: {exc}") from exc


def _write_all(out: WriteSink, view: memoryview) -> None:
    """``out.write`` until all of ``view`` is taken (raw files may take part of a buffer)."""
    while view.nbytes:
        written = out.write(view)
        if written is None or written >= view.nbytes:
            return
        view = view[written:]


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
]
