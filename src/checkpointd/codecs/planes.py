"""Chunks of the ``zstd-planes`` container: each chunk stored as byte planes, one zstd frame or raw.

:mod:`checkpointd.codecs.compress` documents the container and drives these functions on its pool
threads, one chunk at a time. Encoding judges a sample of the chunk (:func:`choose_planes`), then
splits float elements into byte planes (:mod:`checkpointd.codecs.plane_kernels`) and Huffman-codes
the planes worth it (:mod:`checkpointd.codecs.huffman`: exponents, mostly). Decoding writes straight into the chunk's
slot of the caller's output buffer: no per-chunk ``bytes`` is allocated, and the caller's thread
copies nothing; temporaries live in per-thread scratch (:mod:`checkpointd.codecs.zstd_frames`).

Encoding builds each frame in a buffer of :data:`FRAME_BUFFERS` (:func:`encode_planes`). Speeds, native
and NumPy: :mod:`checkpointd.codecs.plane_kernels`. Every chunk verifies on its own: a CRC-32 of its
stored bytes, checked before merging.
"""

from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from checkpointd.codecs import huffman
from checkpointd.codecs.container import FRAME_HEADER
from checkpointd.codecs.crc import crc32
from checkpointd.codecs.frame_buffers import FRAME_BUFFERS
from checkpointd.codecs.plane_kernels import NIBBLES, UINT_BY_ITEMSIZE, from_planes, to_planes, unpack_nibbles
from checkpointd.codecs.zstd_frames import (
    compressor,
    copy_into,
    scratch,
    zstd_decompress_into,
    zstd_decompress_slack,
)
from checkpointd.errors import CorruptCheckpointError
from checkpointd.native import planes as planes_native

_SAMPLE_ELEMENTS = 16 << 10
_SAMPLE_SLICES = 4
RANDOM_ENTROPY_BITS = 7.86
"""A sample plane above this is stored raw untried: zstd keeps Huffman-coded literals only when they save
over 1/64 of the block (``ZSTD_minGain``), impossible above 7.875 bits a byte; 16 Ki samples read ~0.01 low."""
_NIBBLE_COVERAGE = 0.995
"""A compressible plane is nibble-packed when this share of its sample falls in one window of 15 values."""

CHUNK_HEADER = struct.Struct("<BBBxQI")  # kind, itemsize, flags, native size, CRC-32 (see FLAG_CRC_ALL)
PLANE = struct.Struct("<BxxxI")  # mode, stored size
SKIPPABLE_CHUNK_MAGIC = 0x184D2A53

KIND_RAW, KIND_ZSTD, KIND_PLANES = 0, 1, 2
MODE_RAW, MODE_ZSTD, MODE_NIBBLES, MODE_HUFFMAN = 0, 1, 2, 3
"""How a plane is stored. The encoder writes raw and Huffman planes (:mod:`checkpointd.codecs.huffman`);
zstd and nibble planes are read, for files written before the Huffman planes."""
FLAG_ROTATED = 1
FLAG_CRC_ALL = 2  # the chunk CRC covers every stored plane byte (zstd planes then carry no checksum)



# -- encoding -----------------------------------------------------------------------------------------


PLANES_BANNER = (
    b"checkpointd: this file was compressed with codec 'zstd-planes', which the zstd tool cannot\n"
    b"decode (its data sits in skippable frames). Restore native files with:\n"
    b"    checkpointd export STEP_DIR OUT_DIR\n"
)
"""What ``zstd -d`` prints into the output of a planes file: loud, and says what to do."""


def banner_frame() -> bytes:
    """The frame that opens every planes file: :data:`PLANES_BANNER` as a regular zstd frame."""
    return compressor(1).compress(PLANES_BANNER)


def choose_planes(view: memoryview, itemsize: int, level: int) -> list[bool] | None:
    """Judge a sample of elements from a few places across the chunk (tensors are not uniform).

    Returns ``None`` if plain zstd beats planes (zeros, integer-valued floats), else which planes are
    worth coding (all but those whose byte entropy looks uniform). Entropy, not a trial compression,
    sizes the planes: a Huffman code comes within a few hundredths of a bit of it on these planes, and
    a trial would cost more than the histogram.
    """
    count = view.nbytes // itemsize
    if count < _SAMPLE_ELEMENTS:
        return [True] * itemsize
    per_slice = _SAMPLE_ELEMENTS // _SAMPLE_SLICES
    starts = [(count - per_slice) * i // (_SAMPLE_SLICES - 1) * itemsize for i in range(_SAMPLE_SLICES)]
    sample = memoryview(b"".join(view[s : s + per_slice * itemsize] for s in starts))
    lib = _native_for(itemsize)
    if lib is not None:
        entropies = planes_native.sample_entropy(lib, sample, itemsize)
    else:
        entropies = [_entropy_bits(np.bincount(plane, minlength=256)) for plane in to_planes(sample, itemsize)]
    worth, estimate = [], 0.0
    for bits in entropies:
        worth.append(bits < RANDOM_ENTROPY_BITS)
        estimate += per_slice * _SAMPLE_SLICES * (bits / 8 if worth[-1] else 1)
    if len(compressor(level).compress(sample)) < 0.95 * estimate:
        return None
    return worth


def _native_for(itemsize: int) -> Any:
    """The native kernels where they run for ``itemsize``-byte elements (2, 4 or 8), else None (NumPy)."""
    return planes_native.library() if itemsize in (2, 4, 8) else None


def _entropy_bits(counts: np.ndarray) -> float:
    """Shannon entropy of a byte histogram, in bits per byte."""
    freq = counts[counts > 0] / counts.sum()
    return float(-(freq * np.log2(freq)).sum())


def encode_planes(view: memoryview, itemsize: int, worth: list[bool]) -> list[Any]:
    """A chunk payload of kind planes, as one buffer: header, plane table, planes, native tail. A plane
    ``worth`` coding is Huffman-coded, and stored raw if that is not smaller.

    The planes are split straight into the payload's buffer (from :data:`FRAME_BUFFERS`, reused once the
    frame is written), each coded plane is written over the place its raw bytes took, and the planes
    after it move up: no fresh memory is touched per chunk. With the native kernels that is one call
    (``planes_encode.c``), which leaves the GIL to the pool's other threads for the whole chunk."""
    whole = view.nbytes // itemsize * itemsize
    count = whole // itemsize
    head = CHUNK_HEADER.size + PLANE.size * itemsize
    buf = FRAME_BUFFERS.take(head + view.nbytes)
    lib = _native_for(itemsize)
    if lib is not None:
        stored, modes, sizes = planes_native.encode_planes(lib, view, itemsize, count, worth, huffman.BLOCK,
                                                           buf[head : head + whole],
                                                           scratch("huffman", huffman.coded_bound(count)))
        table, at = [PLANE.pack(mode, size) for mode, size in zip(modes, sizes)], head + stored
    else:
        table, at = _encode_planes_numpy(view[:whole], itemsize, count, worth, buf, head)
    end = at + view.nbytes - whole
    buf[at:end] = np.frombuffer(view[whole:], dtype=np.uint8)
    crc = crc32(buf[head:end])
    buf[:head] = np.frombuffer(CHUNK_HEADER.pack(KIND_PLANES, itemsize, FLAG_ROTATED | FLAG_CRC_ALL, view.nbytes, crc)
                               + b"".join(table), dtype=np.uint8)
    return [memoryview(buf)[:end]]  # holds ``buf``, and so the buffer, until the frame is written


def _encode_planes_numpy(view: memoryview, itemsize: int, count: int, worth: list[bool], buf: np.ndarray,
                         head: int) -> tuple[list[bytes], int]:
    """:func:`encode_planes`' planes by the NumPy kernels, into ``buf`` from ``head``: the plane table and the end."""
    planes = to_planes(view, itemsize, buf[head : head + count * itemsize].reshape(itemsize, count))
    table, at = [], head
    for j, (plane, compress) in enumerate(zip(planes, worth)):
        stored = huffman.encode_into(plane, buf[at : at + count]) if compress and count else 0
        mode = MODE_HUFFMAN if stored else MODE_RAW
        if not stored:
            stored, raw_at = count, head + j * count
            if at != raw_at:
                ctypes.memmove(buf.ctypes.data + at, buf.ctypes.data + raw_at, count)
        table.append(PLANE.pack(mode, stored))
        at += stored
    return table, at


def encode_chunk(view: memoryview, itemsize: int, level: int) -> list[Any]:
    """The skippable frame (as parts) of one planes-container chunk: planes (of ``itemsize``-byte float
    elements; 0: not floats), zstd or raw."""
    parts: list[Any] | None = None
    worth = choose_planes(view, itemsize, level) if itemsize and view.nbytes >= itemsize else None
    if worth is not None:
        parts = encode_planes(view, itemsize, worth)
    if parts is None:
        packed = compressor(level).compress(view)
        if len(packed) < view.nbytes:
            parts = [CHUNK_HEADER.pack(KIND_ZSTD, 1, 0, view.nbytes, 0), packed]
        else:
            parts = [CHUNK_HEADER.pack(KIND_RAW, 1, 0, view.nbytes, crc32(view)), view]
    payload_nbytes = sum(memoryview(p).nbytes for p in parts)
    return [FRAME_HEADER.pack(SKIPPABLE_CHUNK_MAGIC, payload_nbytes), *parts]


# -- decoding -----------------------------------------------------------------------------------------


def decode_chunk_into(frame: memoryview, out: np.ndarray) -> None:
    """Decode one planes-container chunk frame into ``out`` (its native bytes, exactly)."""
    kind, itemsize, flags, size, crc = _chunk_header(frame, out.nbytes)
    body = frame[FRAME_HEADER.size + CHUNK_HEADER.size :]
    if kind == KIND_RAW and body.nbytes == size:
        _check_crc(crc32(body), crc)
        copy_into(out, body)
    elif kind == KIND_ZSTD:
        zstd_decompress_into(body, out)
    elif kind == KIND_PLANES and itemsize in UINT_BY_ITEMSIZE:
        _decode_planes_into(body, itemsize, flags, crc, out)
    else:
        raise CorruptCheckpointError(f"bad chunk header (kind {kind}, itemsize {itemsize}, {body.nbytes} bytes)")


def _decode_planes_into(body: memoryview, itemsize: int, flags: int, crc: int, out: np.ndarray) -> None:
    """Native bytes of a planes chunk into ``out``: planes decoded into scratch, then merged into ``out``."""
    native_nbytes = out.nbytes
    count = native_nbytes // itemsize
    pos, actual_crc = PLANE.size * itemsize, 0
    crc_all = bool(flags & FLAG_CRC_ALL)
    if crc_all:  # one CRC call over planes and tail (contiguous), before any plane is parsed
        _check_crc(crc32(body[PLANE.size * itemsize :]), crc)
    flat = scratch("planes", count * itemsize + 1)  # + 1: slack for zstd_decompress_slack
    decoded = flat[: count * itemsize].reshape(itemsize, count)
    lib = planes_native.library()
    planes: list[np.ndarray] = []  # NumPy kernels: every plane's bytes
    native: list[tuple[int, Any, int, Any, int]] = []  # native kernel: planes and nibble codes as stored
    for i in range(itemsize):
        mode, stored = PLANE.unpack_from(body, PLANE.size * i)
        blob = body[pos : pos + stored]
        pos += stored
        if blob.nbytes != stored or (mode == MODE_RAW and stored != count):
            raise CorruptCheckpointError(f"bad plane {i} (mode {mode}, {blob.nbytes} of {stored} bytes)")
        if mode == MODE_RAW and not crc_all:
            actual_crc = crc32(blob, actual_crc)
        if mode == MODE_RAW:
            planes.append(np.frombuffer(blob, dtype=np.uint8))
        elif mode == MODE_HUFFMAN:
            planes.append(decoded[i])
            huffman.decode_into(blob, decoded[i])
        elif mode == MODE_ZSTD:
            planes.append(decoded[i])
            zstd_decompress_slack(blob, flat[i * count : (i + 1) * count + 1])  # slack: next plane's
        elif mode == MODE_NIBBLES and flags & FLAG_CRC_ALL and stored >= NIBBLES.size:
            base, escaped, packed = _read_nibbles(blob, count, f"packed{i}" if lib is not None else "packed")
            if lib is not None:
                half = (count + 1) // 2
                native.append((1, packed, base, packed[half:], escaped))
                continue
            planes.append(decoded[i])
            unpack_nibbles(base, escaped, packed, decoded[i])
        else:
            raise CorruptCheckpointError(f"bad plane {i} (mode {mode}, {blob.nbytes} bytes)")
        if lib is not None:
            native.append((0, planes[-1], 0, None, 0))
    tail = body[pos:]
    if tail.nbytes != native_nbytes - count * itemsize:
        raise CorruptCheckpointError(f"planes chunk has {tail.nbytes} tail bytes, expected {native_nbytes % itemsize}")
    if not crc_all:
        _check_crc(crc32(tail, actual_crc), crc)
    copy_into(out[count * itemsize :], tail)
    if not count:
        return
    if lib is None:
        from_planes(planes, out[: count * itemsize], rotated=bool(flags & FLAG_ROTATED))
        return
    bad = planes_native.decode_planes(lib, native, count, bool(flags & FLAG_ROTATED), out[: count * itemsize])
    if bad:
        _, _, _, _, escaped = native[bad - 1]
        raise CorruptCheckpointError(f"nibble plane {bad - 1} has a different number of escape codes than "
                                     f"its header says ({escaped})")


def _chunk_header(frame: memoryview, native_nbytes: int) -> tuple[int, int, int, int, int]:
    """``(kind, itemsize, flags, native size, crc)`` of a chunk frame whose index entry says ``native_nbytes``."""
    if frame.nbytes < FRAME_HEADER.size + CHUNK_HEADER.size:
        raise CorruptCheckpointError(f"chunk frame of {frame.nbytes} bytes is too short")
    magic, payload_nbytes = FRAME_HEADER.unpack_from(frame)
    if magic != SKIPPABLE_CHUNK_MAGIC or payload_nbytes != frame.nbytes - FRAME_HEADER.size:
        raise CorruptCheckpointError(f"bad chunk frame header (magic {magic:#x}, size {payload_nbytes})")
    header = CHUNK_HEADER.unpack_from(frame, FRAME_HEADER.size)
    if header[3] != native_nbytes:
        raise CorruptCheckpointError(f"chunk says {header[3]} native bytes, the index {native_nbytes}")
    return header


@dataclass(frozen=True)
class ChunkLayout:
    """Where the parts of one chunk frame lie, checked against the format (offsets within the frame).

    For decoders that read the parts elsewhere than :func:`decode_chunk_into` (the device decoder of
    :mod:`checkpointd.codecs.planes_device`): ``planes`` holds ``(mode, start, stop)`` per plane of a
    planes chunk (empty for the other kinds), ``crc_range`` the bytes the chunk's CRC covers
    (``None``: a zstd chunk, whose frame carries its own checksum; an older planes chunk without
    ``FLAG_CRC_ALL`` is refused here and left to :func:`decode_chunk_into`).
    """

    kind: int
    itemsize: int
    count: int
    rotated: bool
    crc: int
    body: tuple[int, int]
    planes: list[tuple[int, int, int]]
    tail: tuple[int, int]
    crc_range: tuple[int, int] | None


def read_chunk_layout(frame: memoryview, native_nbytes: int) -> ChunkLayout:
    """The checked layout of one chunk frame of ``native_nbytes`` native bytes.

    Raises:
        CorruptCheckpointError: anything :func:`decode_chunk_into` would refuse before decoding, and a
            nibble plane whose escape count exceeds its values.
    """
    kind, itemsize, flags, size, crc = _chunk_header(frame, native_nbytes)
    body = (FRAME_HEADER.size + CHUNK_HEADER.size, frame.nbytes)
    if kind == KIND_RAW and body[1] - body[0] == size:
        return ChunkLayout(kind, 1, 0, False, crc, body, [], body, body)
    if kind == KIND_ZSTD:
        return ChunkLayout(kind, 1, 0, False, crc, body, [], (body[1], body[1]), None)
    if kind != KIND_PLANES or itemsize not in UINT_BY_ITEMSIZE or not flags & FLAG_CRC_ALL:
        raise CorruptCheckpointError(f"bad chunk header (kind {kind}, itemsize {itemsize}, flags {flags}, "
                                     f"{body[1] - body[0]} bytes)")
    count = size // itemsize
    pos = body[0] + PLANE.size * itemsize
    if pos > frame.nbytes:
        raise CorruptCheckpointError(f"planes chunk of {frame.nbytes} bytes is too short for its plane table")
    planes = []
    for i in range(itemsize):
        mode, stored = PLANE.unpack_from(frame, body[0] + PLANE.size * i)
        if pos + stored > frame.nbytes or mode not in (MODE_RAW, MODE_ZSTD, MODE_NIBBLES, MODE_HUFFMAN) or (
                mode == MODE_RAW and stored != count) or (mode == MODE_NIBBLES and stored < NIBBLES.size):
            raise CorruptCheckpointError(f"bad plane {i} (mode {mode}, {stored} bytes stored, "
                                         f"{frame.nbytes - pos} left in the chunk)")
        if mode == MODE_NIBBLES and NIBBLES.unpack_from(frame, pos)[1] > count:
            raise CorruptCheckpointError(f"nibble plane {i} claims {NIBBLES.unpack_from(frame, pos)[1]} escapes "
                                         f"for {count} values")
        planes.append((mode, pos, pos + stored))
        pos += stored
    if frame.nbytes - pos != size - count * itemsize:
        raise CorruptCheckpointError(f"planes chunk has {frame.nbytes - pos} tail bytes, expected {size % itemsize}")
    crc_range = (body[0] + PLANE.size * itemsize, frame.nbytes)
    return ChunkLayout(kind, itemsize, count, bool(flags & FLAG_ROTATED), crc, body, planes, (pos, frame.nbytes),
                       crc_range)


def _read_nibbles(blob: memoryview, count: int, scratch_name: str) -> tuple[int, int, np.ndarray]:
    """A nibble plane's base, escape count and stored bytes (codes, then escapes), in scratch ``scratch_name``."""
    base, escaped = NIBBLES.unpack_from(blob)
    if escaped > count:
        raise CorruptCheckpointError(f"nibble plane claims {escaped} escapes for {count} values")
    half = (count + 1) // 2
    packed = scratch(scratch_name, half + escaped + 1)
    zstd_decompress_slack(blob[NIBBLES.size :], packed)
    return base, escaped, packed[: half + escaped]


def _check_crc(actual: int, expected: int) -> None:
    if actual != expected:
        raise CorruptCheckpointError(f"CRC-32 of the stored bytes is {actual:#010x}, the chunk says {expected:#010x}")
