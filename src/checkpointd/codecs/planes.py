"""Chunk kernels of :mod:`checkpointd.codecs.compress`: per-thread zstd contexts and the byte-plane transform.

Everything here runs on a pool thread, one chunk at a time, and spends its time in zstd, the native
kernels or NumPy with the GIL released. The byte-plane passes (split and rotate, nibble packing,
nibble unpacking with escapes, merge and rotate back) run in :mod:`checkpointd.native.planes` (C,
one pass over cache-sized blocks, built on first use) wherever a C compiler is found, and in the
NumPy kernels below otherwise; both produce the same bytes. On an H200 host (16 threads, 256 MB
inputs) the native kernels took decompression from 7.1 to 14.0-14.5 GB/s for bf16, 8.4-9.0 to
17.7-18.2 for fp32 and 7.0 to 12.3-13.2 for AdamW moments, compression from 4.5-5.4 to 6.2-8.9.

Decoding writes straight into the chunk's slot of the caller's output buffer: no per-chunk ``bytes``
is allocated (allocating, faulting in and unmapping 4 MiB per chunk from many threads at once
serializes in the kernel), and the caller's thread copies nothing. Temporaries that a chunk needs
(compressed planes decoded, rotated elements) live in per-thread scratch arrays reused from chunk to
chunk. The file format is described in :mod:`checkpointd.codecs.compress`.

The rest of this docstring is about the NumPy kernels (the fallback) and how they were tuned.
Costs per 4 MiB fp32 chunk on one dev-VM core (randn * 0.02): encode 1.9 ms (was 3.0: exponent plane
nibble-packed before zstd, 1.3 -> 0.45 ms; entropy instead of trial compressions when sampling; no
zstd checksums, the chunk CRC covers the stored bytes), decode 1.8 ms (was 2.2: packed exponent plane
0.45 -> 0.3 ms; planes merged by the widen/OR tree in cache-sized blocks instead of strided columns).

Why the shape is few, big NumPy calls: each call drops and retakes the GIL, and with 16 codec threads
every retake waits for a hand-off (futex wake-ups, tens of microseconds), so on a 16-core host the
calls per MiB, not one core's speed, bounded throughput (decode 3.6 GB/s at 8.7 calls/MiB, 8 threads
beating 16). Merge and split blocks are 4 MiB (``_MERGE_BYTES``), 4-byte elements merge by byte
columns (4 calls a block instead of the tree's 12) and a planes chunk's CRC is one call over its
contiguous stored bytes. Per 16 MiB chunk on a dev-VM core, measured by counting
``PyEval_SaveThread`` calls and the time between them: decode 139 -> 44 GIL releases (8.7 -> 2.8 per
MiB; GIL held 7.5% -> ~5% of the time), encode 132 -> 92 fp32 and 60 bf16; one core decodes fp32
about 10% slower (7.8 -> 8.5 ms), bf16 and encode within noise. Tried and slower: casting ufuncs
(``np.multiply(u8, np.uint16(256), out=u16)``, output-narrowing shifts), ``np.einsum`` of a stacked
plane array, whole-chunk blocks, strided gathers when encoding.

Decode, second pass (bf16 decoded at 3.2x one core on 16 threads, fp32 at 4.9x; both 44 releases a
chunk). The shim's held intervals show why releases cost GIL time too: the first Python after each big
pass runs cache-cold, 5-60 us. Changes, per 16 MiB chunk on a dev-VM core (median of 7): a zstd
frame is read with one ``readinto`` into scratch a byte longer than its content (the end of the frame
and any checksum are reached in that call; the ``read(1)`` that checked for the end held the GIL
40-50 us per 4 MiB plane, decoding the frame's last block in it); nibble escapes go back by one
boolean-mask assignment (2 releases instead of ~10 through :func:`_true_positions`); 2-byte words
OR their low plane in as bytes (3 calls a word instead of 4). Releases: bf16 44 -> 32, fp16 30 -> 26,
fp32 and AdamW 44 -> 36; GIL held ~0.42 -> ~0.35 ms (bf16 ~5% -> ~4% of the time, noisy); one core
within noise (bf16 8.2-8.5 ms both, fp32 8.2-9.2 -> 9.2). Measured and not taken: 8 or 16 MiB merge
blocks (bf16 12 or 6 fewer releases, but 2 threads decode 10-25% slower: the passes leave the caches),
casting the high plane too (2 calls a word, 0.6-1 ms slower a chunk), ``np.divmod`` for the nibble
split (20x slower), ``np.take`` on a 256-entry table (casts the indices to intp: 0.6-1 ms per MiB),
``np.place``/``np.putmask`` for escapes (3-4.6 ms), ``nonzero`` on 8-byte words (1.9 ms), and
``decompress``/``decompressobj`` (allocate the output; ``decompressobj`` releases 32 times).
"""

from __future__ import annotations

import struct
import threading
from typing import Any

import numpy as np
import torch
import zstandard as zstd

from checkpointd.native import planes as planes_native
from checkpointd.codecs.crc import crc32
from checkpointd.errors import CorruptCheckpointError

_SAMPLE_ELEMENTS = 16 << 10
_SAMPLE_SLICES = 4
_RANDOM_ENTROPY_BITS = 7.86
"""A sample plane above this is stored raw untried: zstd keeps Huffman-coded literals only when they save
over 1/64 of the block (``ZSTD_minGain``), impossible above 7.875 bits a byte; 16 Ki samples read ~0.01 low."""
_NIBBLE_COVERAGE = 0.995
"""A compressible plane is nibble-packed when this share of its sample falls in one window of 15 values."""

_FRAME_HEADER = struct.Struct("<II")  # skippable frame: magic, payload size
_CHUNK_HEADER = struct.Struct("<BBBxQI")  # kind, itemsize, flags, native size, CRC-32 (see _FLAG_CRC_ALL)
_PLANE = struct.Struct("<BxxxI")  # mode, stored size
_NIBBLES = struct.Struct("<BxxxI")  # nibble-packed plane: base, escape count; then one zstd frame
_SKIPPABLE_CHUNK_MAGIC = 0x184D2A53

_KIND_RAW, _KIND_ZSTD, _KIND_PLANES = 0, 1, 2
_MODE_RAW, _MODE_ZSTD, _MODE_NIBBLES = 0, 1, 2
_FLAG_ROTATED = 1
_FLAG_CRC_ALL = 2  # the chunk CRC covers every stored plane byte (zstd planes then carry no checksum)
_ESCAPE = 15
_UINT_BY_ITEMSIZE: dict[int, type[np.unsignedinteger[Any]]] = {2: np.uint16, 4: np.uint32, 8: np.uint64}
_INT_BY_ITEMSIZE = {2: np.int16, 4: np.int32, 8: np.int64}
_UINT_BY_WIDTH: dict[int, type[np.unsignedinteger[Any]]] = {1: np.uint8, **_UINT_BY_ITEMSIZE}

_local = threading.local()


# -- per-thread zstd contexts and scratch -------------------------------------------------------------


def compressor(level: int) -> zstd.ZstdCompressor:
    """This thread's compressor for ``level`` (zstd contexts are not thread-safe, and costly to make)."""
    cache = _local.__dict__.setdefault("compressors", {})
    if level not in cache:
        cache[level] = zstd.ZstdCompressor(level=level, write_checksum=True)
    return cache[level]


def _plane_compressor() -> zstd.ZstdCompressor:
    """This thread's compressor for byte planes: Huffman literals, almost no matches.

    Exponent planes hold ~2.5 bits of entropy per byte spread evenly, so short LZ matches abound and
    cost more than they save; level 1 reaches 2.8x at 0.3 GB/s, these parameters 3.05x at 0.8 GB/s.
    No frame checksum: the chunk's CRC-32 covers the stored bytes (``_FLAG_CRC_ALL``), 3x cheaper.
    """
    comp = getattr(_local, "plane_compressor", None)
    if comp is None:
        params = zstd.ZstdCompressionParameters(
            strategy=zstd.STRATEGY_FAST, window_log=17, hash_log=6, chain_log=6, search_log=1,
            min_match=7, target_length=0, write_checksum=False,
        )  # fmt: skip
        comp = _local.plane_compressor = zstd.ZstdCompressor(compression_params=params)
    return comp


def _decompressor() -> zstd.ZstdDecompressor:
    dctx = getattr(_local, "decompressor", None)
    if dctx is None:
        dctx = _local.decompressor = zstd.ZstdDecompressor()
    return dctx


def _scratch(name: str, nbytes: int) -> np.ndarray:
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


def _zstd_decompress_slack(frame: Any, buf: np.ndarray) -> None:
    """Decode one zstd frame of ``buf.nbytes - 1`` bytes into ``buf`` (the last byte is slack).

    One ``readinto`` with a byte to spare decodes to the frame's end (checksum included, if any) and
    shows a frame that is too long; :func:`zstd_decompress_into`'s ``read(1)`` after filling exactly
    held the GIL for 40-50 us per 4 MiB plane (zstd finished the frame's last block in it).
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


# -- planes: encoding ---------------------------------------------------------------------------------


def plane_itemsize(dtype: torch.dtype | None) -> int:
    """Element size to cut planes at, or 0 for data that planes do not help (ints, bool, float8)."""
    if dtype is None:
        return 0
    if dtype.is_complex:
        dtype = dtype.to_real()
    return dtype.itemsize if dtype.is_floating_point and dtype.itemsize in _UINT_BY_ITEMSIZE else 0


def _to_planes(view: Any, itemsize: int) -> np.ndarray:
    """(itemsize, n) planes of the rotated elements in ``view`` (whole elements only).

    Plane ``j`` is byte ``j`` of each element rotated left by one bit, computed without materializing
    the rotation or transposing bytes: for ``j >= 1`` it is ``x >> (8j - 1)`` truncated to a byte (one
    contiguous shift into per-thread scratch, one SIMD narrowing copy); plane 0 is ``x`` truncated,
    doubled, with the sign bit added. Every pass is contiguous, about 2-3x faster than the strided byte
    copies of a transpose. (NumPy's ``uint8`` left shift is scalar code; multiplying by 2 is not.)
    Blocks of ``_MERGE_BYTES`` keep the shift scratch in cache.
    """
    count = memoryview(view).nbytes // itemsize
    planes = np.empty((itemsize, count), dtype=np.uint8)
    lib = planes_native.library()
    if lib is not None and count:
        planes_native.split_planes(lib, view, itemsize, count, planes)
        return planes
    all_elems = np.frombuffer(view, dtype=_UINT_BY_ITEMSIZE[itemsize], count=count)
    block = _MERGE_BYTES // itemsize
    for start in range(0, count, block):
        stop = min(count, start + block)
        elems = all_elems[start:stop]
        shifted = _scratch("shifted", (stop - start) * itemsize).view(elems.dtype)
        for j in range(1, itemsize):
            np.right_shift(elems, 8 * j - 1, out=shifted)
            np.copyto(planes[j, start:stop], shifted, casting="unsafe")
        low = planes[0, start:stop]
        np.copyto(low, elems, casting="unsafe")
        np.multiply(low, 2, out=low)
        sign = _scratch("sign", stop - start)
        np.less(elems.view(_INT_BY_ITEMSIZE[itemsize]), 0, out=sign.view(np.bool_))
        low |= sign
    return planes


def choose_planes(view: memoryview, itemsize: int, level: int) -> tuple[list[bool], list[int | None]] | None:
    """Judge a sample of elements from a few places across the chunk (tensors are not uniform).

    Returns ``None`` if plain zstd beats planes (zeros, integer-valued floats), else which planes are
    worth a zstd attempt (all but those whose byte entropy looks uniform) and, for each, the base of a
    nibble window if it is to be packed (see :func:`_pack_nibbles`). Entropy, not a trial compression,
    sizes the planes: on a small sample zstd's table overhead hides the 2-9% that skewed mantissa
    planes gain on a whole chunk, and the trial would cost more than the histogram.
    """
    count = view.nbytes // itemsize
    if count < _SAMPLE_ELEMENTS:
        return [True] * itemsize, [None] * itemsize
    per_slice = _SAMPLE_ELEMENTS // _SAMPLE_SLICES
    starts = [(count - per_slice) * i // (_SAMPLE_SLICES - 1) * itemsize for i in range(_SAMPLE_SLICES)]
    sample = memoryview(b"".join(view[s : s + per_slice * itemsize] for s in starts))
    worth, bases, estimate = [], [], 0.0
    for plane in _to_planes(sample, itemsize):
        counts = np.bincount(plane, minlength=256)
        bits = _entropy_bits(counts)
        worth.append(bits < _RANDOM_ENTROPY_BITS)
        estimate += plane.size * (bits / 8 if worth[-1] else 1)
        window = np.convolve(counts, np.ones(_ESCAPE, dtype=np.int64), mode="valid")  # window[b]: values b..b+14
        base = int(window.argmax())
        bases.append(base if worth[-1] and window[base] >= _NIBBLE_COVERAGE * plane.size else None)
    if len(compressor(level).compress(sample)) < 0.95 * estimate:
        return None
    return worth, bases


def _entropy_bits(counts: np.ndarray) -> float:
    """Shannon entropy of a byte histogram, in bits per byte."""
    freq = counts[counts > 0] / counts.sum()
    return float(-(freq * np.log2(freq)).sum())


def _true_positions(mask: np.ndarray) -> np.ndarray:
    """``np.flatnonzero(mask)`` for a sparse bool array, ~4x faster: nonzero 8-byte words first."""
    whole = mask.size // 8 * 8
    words = mask[:whole].view(np.uint64)
    hit = _scratch("hit", words.size).view(np.bool_)
    np.not_equal(words, 0, out=hit)
    candidates = (np.flatnonzero(hit)[:, None] * 8 + np.arange(8)).ravel()
    found = candidates[mask[candidates]]
    return np.concatenate([found, whole + np.flatnonzero(mask[whole:])]) if whole < mask.size else found


def _pack_nibbles(plane: np.ndarray, base: int) -> list[Any] | None:
    """A plane as 4-bit codes ``value - base`` (15: escape), two a byte, zstd-compressed with the escapes.

    Exponent planes hold ~2.5 bits a byte, nearly all in 15 consecutive values: packing halves the
    symbols zstd's Huffman stage codes, so the plane compresses 2.9x faster and decodes 1.7x faster,
    0.5% smaller. Code ``k`` sits in the high nibble of byte ``k`` for ``k < h = ceil(n / 2)``, code
    ``h + k`` in its low nibble; the escaped values follow the ``h`` bytes, in element order. ``None``
    if more than 1/128 of the plane escapes: finding escapes when decoding would cost more than it saves.
    """
    count, half = plane.size, (plane.size + 1) // 2
    lib = planes_native.library()
    if lib is not None:
        packed = _scratch("packed", half + count // 128)
        escaped = planes_native.pack_nibbles(lib, plane, base, packed, count // 128)
        if escaped < 0:
            return None
        return [_NIBBLES.pack(base, escaped), _plane_compressor().compress(packed[: half + escaped].data)]
    codes = _scratch("codes", 2 * half)
    codes[count:] = 0
    np.subtract(plane, np.uint8(base), out=codes[:count])
    mask = _scratch("mask", count).view(np.bool_)
    np.greater_equal(codes[:count], _ESCAPE, out=mask)
    escapes = _true_positions(mask)
    if escapes.size * 128 > count:
        return None
    codes[escapes] = _ESCAPE  # (NumPy's uint8 minimum is scalar code, 15x slower than this)
    packed = _scratch("packed", half + escapes.size)
    np.multiply(codes[:half], np.uint8(16), out=packed[:half])
    packed[:half] |= codes[half:]
    packed[half:] = plane[escapes]
    return [_NIBBLES.pack(base, escapes.size), _plane_compressor().compress(packed.data)]


def encode_planes(
    view: memoryview, itemsize: int, worth: list[bool], bases: list[int | None] | None = None
) -> list[Any]:
    """Chunk payload parts of kind planes: header, plane table, planes, native tail."""
    whole = view.nbytes // itemsize * itemsize
    planes = _to_planes(view[:whole], itemsize)
    table, blobs, crc = [], [], 0
    for plane, compress, base in zip(planes, worth, bases or [None] * itemsize):
        parts = _pack_nibbles(plane, base) if base is not None else None
        mode = _MODE_NIBBLES
        if parts is None and compress:
            parts, mode = [_plane_compressor().compress(plane)], _MODE_ZSTD
        stored = sum(len(p) for p in parts) if parts is not None else plane.nbytes
        if parts is None or stored >= plane.nbytes:
            parts, mode, stored = [plane], _MODE_RAW, plane.nbytes
        table.append(_PLANE.pack(mode, stored))
        for part in parts:
            crc = crc32(part, crc)
        blobs += parts
    crc = crc32(view[whole:], crc)
    flags = _FLAG_ROTATED | _FLAG_CRC_ALL
    header = _CHUNK_HEADER.pack(_KIND_PLANES, itemsize, flags, view.nbytes, crc) + b"".join(table)
    return [header, *blobs, view[whole:]]


def encode_chunk(view: memoryview, dtype: torch.dtype | None, level: int) -> list[Any]:
    """The skippable frame (as parts) of one planes-container chunk: planes, zstd or raw."""
    itemsize = plane_itemsize(dtype)
    parts: list[Any] | None = None
    choice = choose_planes(view, itemsize, level) if itemsize and view.nbytes >= itemsize else None
    if choice is not None:
        parts = encode_planes(view, itemsize, *choice)
    if parts is None:
        packed = compressor(level).compress(view)
        if len(packed) < view.nbytes:
            parts = [_CHUNK_HEADER.pack(_KIND_ZSTD, 1, 0, view.nbytes, 0), packed]
        else:
            parts = [_CHUNK_HEADER.pack(_KIND_RAW, 1, 0, view.nbytes, crc32(view)), view]
    payload_nbytes = sum(memoryview(p).nbytes for p in parts)
    return [_FRAME_HEADER.pack(_SKIPPABLE_CHUNK_MAGIC, payload_nbytes), *parts]


# -- planes: decoding ---------------------------------------------------------------------------------


def decode_chunk_into(frame: memoryview, out: np.ndarray) -> None:
    """Decode one planes-container chunk frame into ``out`` (its native bytes, exactly)."""
    native_nbytes = out.nbytes
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
        _check_crc(crc32(body), crc)
        copy_into(out, body)
    elif kind == _KIND_ZSTD:
        zstd_decompress_into(body, out)
    elif kind == _KIND_PLANES and itemsize in _UINT_BY_ITEMSIZE:
        _decode_planes_into(body, itemsize, flags, crc, out)
    else:
        raise CorruptCheckpointError(f"bad chunk header (kind {kind}, itemsize {itemsize}, {body.nbytes} bytes)")


def _decode_planes_into(body: memoryview, itemsize: int, flags: int, crc: int, out: np.ndarray) -> None:
    """Native bytes of a planes chunk into ``out``: planes decoded into scratch, then merged into ``out``."""
    native_nbytes = out.nbytes
    count = native_nbytes // itemsize
    pos, actual_crc = _PLANE.size * itemsize, 0
    crc_all = bool(flags & _FLAG_CRC_ALL)  # then one CRC call over planes and tail (contiguous), below
    flat = _scratch("planes", count * itemsize + 1)  # + 1: slack for _zstd_decompress_slack
    decoded = flat[: count * itemsize].reshape(itemsize, count)
    lib = planes_native.library()
    planes: list[np.ndarray] = []  # NumPy kernels: every plane's bytes
    native: list[tuple[int, Any, int, Any, int]] = []  # native kernel: planes and nibble codes as stored
    for i in range(itemsize):
        mode, stored = _PLANE.unpack_from(body, _PLANE.size * i)
        blob = body[pos : pos + stored]
        pos += stored
        if blob.nbytes != stored or (mode == _MODE_RAW and stored != count):
            raise CorruptCheckpointError(f"bad plane {i} (mode {mode}, {blob.nbytes} of {stored} bytes)")
        if mode == _MODE_RAW and not crc_all:
            actual_crc = crc32(blob, actual_crc)
        if mode == _MODE_RAW:
            planes.append(np.frombuffer(blob, dtype=np.uint8))
        elif mode == _MODE_ZSTD:
            planes.append(decoded[i])
            _zstd_decompress_slack(blob, flat[i * count : (i + 1) * count + 1])  # slack: next plane's
        elif mode == _MODE_NIBBLES and flags & _FLAG_CRC_ALL and stored >= _NIBBLES.size:
            base, escaped, packed = _read_nibbles(blob, count, f"packed{i}" if lib is not None else "packed")
            if lib is not None:
                half = (count + 1) // 2
                native.append((1, packed, base, packed[half:], escaped))
                continue
            planes.append(decoded[i])
            _unpack_nibbles(base, escaped, packed, decoded[i])
        else:
            raise CorruptCheckpointError(f"bad plane {i} (mode {mode}, {blob.nbytes} bytes)")
        if lib is not None:
            native.append((0, planes[-1], 0, None, 0))
    tail = body[pos:]
    if tail.nbytes != native_nbytes - count * itemsize:
        raise CorruptCheckpointError(f"planes chunk has {tail.nbytes} tail bytes, expected {native_nbytes % itemsize}")
    _check_crc(crc32(body[_PLANE.size * itemsize :] if crc_all else tail, actual_crc), crc)
    copy_into(out[count * itemsize :], tail)
    if not count:
        return
    if lib is None:
        _from_planes(planes, out[: count * itemsize], rotated=bool(flags & _FLAG_ROTATED))
        return
    bad = planes_native.decode_planes(lib, native, count, bool(flags & _FLAG_ROTATED), out[: count * itemsize])
    if bad:
        _, _, _, _, escaped = native[bad - 1]
        raise CorruptCheckpointError(f"nibble plane {bad - 1} has a different number of escape codes than "
                                     f"its header says ({escaped})")


def _read_nibbles(blob: memoryview, count: int, scratch: str) -> tuple[int, int, np.ndarray]:
    """A nibble plane's base, escape count and stored bytes (codes, then escapes), decoded into ``scratch``."""
    base, escaped = _NIBBLES.unpack_from(blob)
    if escaped > count:
        raise CorruptCheckpointError(f"nibble plane claims {escaped} escapes for {count} values")
    half = (count + 1) // 2
    packed = _scratch(scratch, half + escaped + 1)
    _zstd_decompress_slack(blob[_NIBBLES.size :], packed)
    return base, escaped, packed[: half + escaped]


def _unpack_nibbles(base: int, escaped: int, packed: np.ndarray, plane: np.ndarray) -> None:
    """Inverse of :func:`_pack_nibbles` (NumPy kernels), into ``plane``: 5 NumPy calls.

    Escapes are put back by a boolean-mask assignment, which fills the masked places in order (what
    the format stores) in one call, skipping runs of unmasked bytes a word at a time: bf16 chunk
    (1298 escapes in 8 Mi values) 2 releases and 0.9 ms; finding the positions first
    (:func:`_true_positions`, still used to encode) takes 0.33 ms but ~10 releases.
    """
    count, half = plane.size, (plane.size + 1) // 2
    np.right_shift(packed[:half], 4, out=plane[:half])
    np.bitwise_and(packed[: count - half], 15, out=plane[half:])
    if escaped:
        mask = _scratch("mask", count).view(np.bool_)
        np.equal(plane, _ESCAPE, out=mask)
    plane += np.uint8(base)
    if escaped:
        values = packed[half : half + escaped]
        where: np.ndarray = np.flatnonzero(mask) if escaped == 1 else mask  # 1 value would broadcast
        try:
            if where.size != 1 and where.dtype != np.bool_:
                raise ValueError
            plane[where] = values
        except ValueError:
            found = np.count_nonzero(mask)
            raise CorruptCheckpointError(f"nibble plane has {found} escape codes, its header says {escaped}") from None


def _from_planes(planes: list[np.ndarray], out: np.ndarray, rotated: bool = True) -> None:
    """Interleave ``planes`` (byte ``j`` of each element in ``planes[j]``) into ``out``, rotate back.

    Runs in blocks of ``_MERGE_BYTES`` of output, a few NumPy calls each (see :func:`_merge_columns`
    and :func:`_merge_tree` for which shape each element size gets, and the module docstring for why).
    """
    itemsize = len(planes)
    count = planes[0].shape[0]
    block = _MERGE_BYTES // itemsize
    merge = _merge_columns if itemsize == 4 else _merge_tree
    for start in range(0, count, block):
        stop = min(count, start + block)
        merge([p[start:stop] for p in planes], out[start * itemsize : stop * itemsize])
        if rotated:
            _rotate_right(out[start * itemsize : stop * itemsize].view(_UINT_BY_ITEMSIZE[itemsize]))


_MERGE_BYTES = 4 << 20
"""Output bytes merged (and input bytes split, :func:`_to_planes`) per block: 4 calls a block for
4-byte elements. Every NumPy call drops and retakes the GIL, and with 16 threads each retake waits
for a hand-off (tens of microseconds), so fewer, bigger calls; 4 MiB still mostly stays in L2/L3."""


def _merge_columns(planes: list[np.ndarray], out: np.ndarray) -> None:
    """4-byte elements: plane 0 widened into ``out``, planes 1-3 copied into its byte columns.

    The strided byte copies are scalar loops (~1 cycle a byte) but insensitive to block size, and
    they take 4 calls where the widen / multiply / OR tree takes 12: 0.55 vs 0.6 ms per MiB of
    elements on a dev-VM core at 4 MiB blocks (the tree needs 2 MiB blocks for 0.58 ms, 2x the calls).
    """
    elems = out.view(np.uint32)
    np.copyto(elems, planes[0])  # byte 0, upper bytes zero
    columns = out.reshape(-1, 4)
    for j in (1, 2, 3):
        columns[:, j] = planes[j]


def _merge_tree(planes: list[np.ndarray], out: np.ndarray) -> None:
    """2- and 8-byte elements: planes paired into 2-byte words by widen / multiply / OR passes.

    The low plane of a pair is ORed in as bytes (a casting ufunc: NumPy widens it a buffer at a time,
    in cache), so a pair takes 3 calls and no widened temporary: bf16 decode 36 -> 32 GIL releases per
    16 MiB chunk, one core as fast (8.8 vs 9.2 ms per 16 MiB, median). Casting the high plane too
    (``np.multiply(u8, np.uint16(256), out=u16)``, 2 calls) was 0.6-1 ms slower. For 8-byte elements
    the 2-byte words go into ``out``'s columns by strided copies (a further tree level costs more than
    it saves). Byte columns instead would cost a strided byte copy per plane, slower here: bf16 2.8 vs
    4.2 ms per 16 MiB on a dev-VM core.
    """
    itemsize = len(planes)
    count = planes[0].shape[0]
    words = out.view(np.uint16)
    columns = words.reshape(count, itemsize // 2)
    for c in range(itemsize // 2):
        dst = words if itemsize == 2 else _scratch("merge_word", 2 * count).view(np.uint16)
        np.copyto(dst, planes[2 * c + 1])
        np.multiply(dst, np.uint16(256), out=dst)  # << 8 (shifts are slower)
        np.bitwise_or(dst, planes[2 * c], out=dst)
        if itemsize != 2:
            columns[:, c] = dst


def _rotate_right(elems: np.ndarray) -> None:
    """Rotate unsigned ``elems`` right by one bit in place (3 calls)."""
    uint = elems.dtype.type
    low = _scratch("low", elems.nbytes).view(uint)
    np.right_shift(elems, 1, out=low)
    np.multiply(elems, uint(1 << (elems.itemsize * 8 - 1)), out=elems)
    elems |= low


def _check_crc(actual: int, expected: int) -> None:
    if actual != expected:
        raise CorruptCheckpointError(f"CRC-32 of the stored bytes is {actual:#010x}, the chunk says {expected:#010x}")
