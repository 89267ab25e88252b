"""Huffman-coded byte planes: the entropy stage of ``zstd-planes`` that a GPU can decode, safely, in parallel.

Why not zstd for the exponent planes: a restore into CUDA tensors decodes a planes file on the device
(:mod:`checkpointd.codecs.planes_device`), and the only GPU zstd decoder at hand (nvCOMP's) is
documented to take valid input only, which checkpoint bytes are not. A plane coded here is cut into
blocks of :data:`BLOCK` symbols whose bit offsets are stored, so every block decodes on its own (one
GPU thread each, :mod:`checkpointd.restore.device_huffman`), and a decoder of this format is simple
enough to make safe on any input: it reads only its block's bytes, and a block that does not decode to
exactly its symbols ending at exactly its end is refused. On exponent planes the ratio is zstd's (whose
literals are Huffman-coded too), and the C coder runs at 1-2 GB/s a core, as fast as zstd here.

The stored plane (``docs/format.md``, plane mode 3)::

    <u32 block symbols B><u32 block count K>     K = ceil(n / B)
    128 bytes of code lengths                    symbol 2i in the low nibble of byte i, 2i + 1 in the high
    K x <u32 end>                                the bit where block k ends (block 0 starts at bit 0)
    the bit stream                               exactly ceil(end[K - 1] / 8) bytes

Code lengths are 0 (no code) to :data:`MAX_BITS`; codes are canonical (ordered by length, then
symbol); bit ``i`` of the stream is bit ``i % 8`` of byte ``i // 8``, and a code's most significant
bit comes first.
"""

from __future__ import annotations

import functools
import heapq
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from checkpointd.codecs.zstd_frames import scratch
from checkpointd.errors import CorruptCheckpointError
from checkpointd.native import planes as planes_native

HEADER = struct.Struct("<II")
"""Block symbols, block count."""
MAX_BITS = 11
"""Longest code: a decode table of 2**11 entries (4 KiB) stays in a GPU's L1 and a core's L1."""
BLOCK = 4096
"""Symbols per block written: 32 bits of offset per 4096 symbols (0.008 bits each), and enough blocks
for a GPU (a 4 MiB plane: 1024 threads)."""
LENGTHS_NBYTES = 128
"""Bytes of code lengths after the header (two lengths a byte); the block ends follow them."""
_MAX_BLOCK = 1 << 20


def coded_bound(count: int) -> int:
    """At most how many bytes a plane of ``count`` symbols takes coded (header, lengths, block ends and
    stream, with the native coder's 16 bytes of slack): the scratch a coder writes it into."""
    return HEADER.size + LENGTHS_NBYTES + 4 * -(-count // BLOCK) + (count * MAX_BITS + 7) // 8 + 16


@dataclass(frozen=True)
class StoredPlane:
    """The checked layout of a stored Huffman plane of ``count`` symbols (offsets within the stored bytes)."""

    lengths: np.ndarray
    block: int
    ends: np.ndarray
    stream: tuple[int, int]


def code_lengths(counts: np.ndarray) -> np.ndarray:
    """Huffman code lengths (uint8, 256) for byte counts, at most :data:`MAX_BITS`; 0 for absent bytes.

    Lengths over the limit are avoided by halving the counts (keeping every present byte at least 1)
    the fewest times that makes the tree fit (found by bisection: large chunks of skewed exponents need
    ten halvings, and each tree costs ~0.07 ms in Python); it costs <0.1% of the ratio.
    """
    lib = planes_native.library()
    if lib is not None:  # the same lengths, ~50x faster (a device encoder makes hundreds per save)
        return planes_native.code_lengths(lib, counts, MAX_BITS)
    counts = np.asarray(counts, dtype=np.int64)
    present = np.flatnonzero(counts)
    lengths = np.zeros(256, dtype=np.uint8)
    if present.size == 0:
        return lengths
    if present.size == 1:
        lengths[present[0]] = 1
        return lengths
    weights = counts[present]
    depth = _tree_depths(weights)
    if depth.max() > MAX_BITS:  # the fewest halvings that fit: doubling, then bisection
        fits, low, high = None, 0, 1
        while fits is None:
            depth = _tree_depths(np.maximum(weights >> high, 1))
            if depth.max() <= MAX_BITS:
                fits = depth
            else:
                low, high = high, 2 * high
        while high - low > 1:
            mid = (low + high) // 2
            depth = _tree_depths(np.maximum(weights >> mid, 1))
            if depth.max() <= MAX_BITS:
                fits, high = depth, mid
            else:
                low = mid
        depth = fits
    lengths[present] = depth
    return lengths


def _tree_depths(weights: np.ndarray) -> np.ndarray:
    heap = [(int(w), i) for i, w in enumerate(weights)]
    heapq.heapify(heap)
    parent = list(range(len(weights)))
    nxt = len(weights)
    while len(heap) > 1:
        w1, a = heapq.heappop(heap)
        w2, b = heapq.heappop(heap)
        parent.append(nxt)
        parent[a] = parent[b] = nxt
        heapq.heappush(heap, (w1 + w2, nxt))
        nxt += 1
    depth = [0] * nxt
    for node in range(nxt - 2, -1, -1):  # parents are numbered after their children
        depth[node] = depth[parent[node]] + 1
    return np.array(depth[: len(weights)], dtype=np.int64)


_REVERSED = np.array([int(f"{i:0{MAX_BITS}b}"[::-1], 2) for i in range(1 << MAX_BITS)], dtype=np.int64)
"""Each 11-bit number with its bits in reverse order."""


def _canonical(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For rows of code lengths (``(planes, 256)``): the bytes in canonical order (by length, then value;
    bytes without a code last), their lengths and their widths ``2**(11 - length)`` (0 without a code). A
    canonical code, padded to 11 bits most significant bit first, starts where the codes before it end."""
    symbols = np.arange(256, dtype=np.int64)
    order = np.argsort(np.where(rows > 0, rows * 256 + symbols, 1 << 20), axis=1, kind="stable")
    sorted_lengths = np.take_along_axis(rows, order, axis=1)
    widths = np.where(sorted_lengths > 0, np.left_shift(1, MAX_BITS - np.minimum(sorted_lengths, MAX_BITS)), 0)
    return order, sorted_lengths, widths


def canonical_codes(lengths: np.ndarray) -> np.ndarray:
    """Each byte's code (uint16), bit-reversed so that the bit read first is bit 0."""
    order, sorted_lengths, widths = (a[0] for a in _canonical(np.asarray(lengths, dtype=np.int64).reshape(1, 256)))
    codes = np.zeros(256, dtype=np.uint16)
    coded = sorted_lengths > 0
    # reversing a code's 11 padded bits leaves the reversed code in its low bits
    codes[order[coded]] = _REVERSED[(np.cumsum(widths) - widths)[coded]]
    return codes


def decode_tables(lengths: np.ndarray) -> np.ndarray:
    """Decode tables (uint16, ``(planes, 2**MAX_BITS)``) for rows of code lengths (``(planes, 256)``): entry
    ``length << 8 | byte`` for every bit pattern (read least significant bit first) that starts with that
    byte's code, 0 for patterns that start no code. A few array operations for all rows together.

    Read most significant bit first, a table is each coded byte in canonical order repeated
    ``2**(11 - length)`` times, then zeros; reversing the 11 bits of the index reads it the other way.
    """
    order, sorted_lengths, widths = _canonical(np.asarray(lengths, dtype=np.int64).reshape(-1, 256))
    entries = ((sorted_lengths << 8) | order).astype(np.uint16)
    rest = (1 << MAX_BITS) - widths.sum(axis=1, keepdims=True)  # patterns no code starts (incomplete codes)
    by_msb = np.repeat(np.concatenate([entries, np.zeros_like(rest, dtype=np.uint16)], axis=1).ravel(),
                       np.concatenate([widths, rest], axis=1).ravel()).reshape(-1, 1 << MAX_BITS)
    return np.take(by_msb, _REVERSED, axis=1)


def decode_table(lengths: np.ndarray) -> np.ndarray:
    """The decode table of one plane's code lengths (:func:`decode_tables`)."""
    return decode_tables(lengths)[0]


def encode(plane: np.ndarray) -> list[Any]:
    """A plane (uint8) as stored bytes: ``[header, lengths and block ends, stream]`` (fresh buffers)."""
    header, stream = _coded(plane)
    return [header, stream.copy()]


def encode_into(plane: np.ndarray, out: np.ndarray) -> int:
    """Write ``plane``'s stored bytes (:func:`encode`'s, joined) into ``out`` (uint8) if they are fewer than
    ``out.nbytes``: how many, or 0 (then nothing is written). ``out`` may overlap ``plane``: the plane
    is read whole first."""
    header, stream = _coded(plane)
    stored = len(header) + stream.nbytes
    if stored >= out.nbytes:
        return 0
    out[: len(header)] = np.frombuffer(header, dtype=np.uint8)
    out[len(header) : stored] = stream
    return stored


def _coded(plane: np.ndarray) -> tuple[bytes, np.ndarray]:
    """The header (with lengths and block ends) and the bit stream of ``plane``; the stream is this thread's
    scratch where the native coder runs: read it before this thread codes another plane."""
    count = plane.size
    lib = planes_native.library()
    counts = planes_native.histogram(lib, plane) if lib is not None else np.bincount(plane, minlength=256)
    lengths = code_lengths(counts)
    codes = canonical_codes(lengths)
    blocks = -(-count // BLOCK)
    ends = np.empty(blocks, dtype=np.uint32)
    if lib is not None:
        stream = scratch("huffman", coded_bound(count))
        stream = stream[: planes_native.huffman_encode(lib, plane, codes, lengths, BLOCK, ends, stream)]
    else:
        stream = encode_stream(plane, codes, lengths, ends)
    packed = (lengths[0::2] | (lengths[1::2] << 4)).astype(np.uint8)
    return HEADER.pack(BLOCK, blocks) + packed.tobytes() + ends.astype("<u4").tobytes(), stream


def encode_stream(plane: np.ndarray, codes: np.ndarray, lengths: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """The NumPy coder: a plane's bit stream (every code's set bits placed in a bit array, then packed),
    its block ends into ``ends``; ``codes`` and ``lengths`` as :func:`canonical_codes` and :func:`code_lengths`."""
    lens = lengths[plane].astype(np.int64)
    bitpos = np.cumsum(lens)
    full = bitpos[BLOCK - 1 :: BLOCK][: ends.size]
    ends[: full.size] = full
    if plane.size:
        ends[-1] = bitpos[-1]
    total = int(bitpos[-1]) if plane.size else 0
    starts = bitpos - lens
    syms_codes = codes[plane].astype(np.int64)
    bits = np.zeros(total, dtype=np.bool_)
    for t in range(MAX_BITS):
        has = np.flatnonzero(lens > t)
        if not has.size:
            break
        on = has[(syms_codes[has] >> t) & 1 == 1]
        bits[starts[on] + t] = True
    return np.packbits(bits, bitorder="little")


def read_plane(stored: Any, count: int) -> StoredPlane:
    """The checked layout of ``stored`` (a mode-3 plane of ``count`` symbols).

    Raises:
        CorruptCheckpointError: a header, code lengths, block table or stream size the format does not allow.
    """
    view = memoryview(stored).cast("B")
    if view.nbytes < HEADER.size + LENGTHS_NBYTES:
        raise CorruptCheckpointError(f"Huffman plane of {view.nbytes} bytes is too short for its header")
    block, blocks = HEADER.unpack_from(view)
    if not 1 <= block <= _MAX_BLOCK or blocks != -(-count // block):
        raise CorruptCheckpointError(f"Huffman plane of {count} symbols has {blocks} blocks of {block}")
    lengths, longest, kraft = _lengths(bytes(view[HEADER.size : HEADER.size + LENGTHS_NBYTES]))
    if longest > MAX_BITS or kraft > 1 << MAX_BITS or (count and not kraft):
        raise CorruptCheckpointError(f"Huffman plane has code lengths no prefix code has (longest "
                                     f"{longest}, Kraft sum {kraft / (1 << MAX_BITS):.3f})")
    at = HEADER.size + LENGTHS_NBYTES
    if view.nbytes < at + 4 * blocks:
        raise CorruptCheckpointError(f"Huffman plane of {view.nbytes} bytes is too short for {blocks} block ends")
    ends = np.frombuffer(view, dtype="<u4", count=blocks, offset=at)
    stream = (at + 4 * blocks, view.nbytes)
    total = int(ends[-1]) if blocks else 0
    if (blocks > 1 and (ends[1:] < ends[:-1]).any()) or stream[1] - stream[0] != (total + 7) // 8:
        raise CorruptCheckpointError(f"Huffman plane's block ends are not increasing or do not end with its "
                                     f"stream ({stream[1] - stream[0]} bytes, {total} bits)")
    return StoredPlane(lengths, block, ends, stream)


@dataclass(frozen=True)
class PlaneAt:
    """A checked plane whose stored bytes start at byte ``src`` of a source buffer, to be decoded into
    ``count`` bytes at ``dst`` of an output buffer."""

    src: int
    plane: StoredPlane
    dst: int
    count: int


def block_table(plane: StoredPlane, count: int) -> tuple[np.ndarray, np.ndarray]:
    """What the block decoders take for one stored plane of ``count`` symbols, decoded from its own bytes
    into a buffer of its symbols: its :func:`block_rows` (table 0) and the decode table. (A restore makes
    the rows of all its planes on the device: :mod:`checkpointd.codecs.huffman_device`.)"""
    return block_rows(plane.ends, 8 * plane.stream[0], 0, count, plane.block), decode_table(plane.lengths)


def block_rows(ends: np.ndarray, first_bit: int, at: int, count: int, block: int, table: int = 0) -> np.ndarray:
    """Per block of a plane of ``count`` symbols, ``(first bit, end bit, output offset, table << 32 | symbols)``
    (int64, ``(blocks, 4)``): its block ``ends`` are in bits from ``first_bit`` (the stream's first bit in
    the source), its symbols go to ``at`` in blocks of ``block``, decoded with decode table ``table``."""
    ends = ends.astype(np.int64)
    k = np.arange(ends.size, dtype=np.int64)
    starts = np.concatenate([np.zeros(1, dtype=np.int64), ends[:-1]])[: ends.size]
    return np.ascontiguousarray(np.stack([first_bit + starts, first_bit + ends, at + k * block,
                                          table << 32 | np.minimum(block, count - k * block)], axis=1))


@functools.lru_cache(maxsize=1024)
def _lengths(packed: bytes) -> tuple[np.ndarray, int, int]:
    """Code lengths from their stored nibbles, the longest, and the Kraft sum in units of 2**-MAX_BITS
    (0 when a length is over the limit). Kept for reuse, read-only."""
    nibbles = np.frombuffer(packed, dtype=np.uint8)
    lengths = np.empty(256, dtype=np.uint8)
    lengths[0::2], lengths[1::2] = nibbles & 15, nibbles >> 4
    lengths.flags.writeable = False
    longest = int(lengths.max())
    kraft = int((1 << (MAX_BITS - lengths[lengths > 0].astype(np.int64))).sum()) if longest <= MAX_BITS else 0
    return lengths, longest, kraft


def decode_blocks(src: Any, dst: np.ndarray, blocks: np.ndarray, tables: np.ndarray) -> int:
    """Decode the blocks of :func:`block_table` from ``src`` into ``dst`` (uint8) on the host: every
    block reads only its own bytes. 0, or ``k + 1`` for a block ``k`` that does not decode."""
    lib = planes_native.library()
    if lib is not None:
        return planes_native.huffman_blocks(lib, src, dst, blocks, tables)
    return _decode_numpy(np.frombuffer(src, dtype=np.uint8), dst, blocks, tables)


def decode_into(stored: Any, out: np.ndarray) -> None:
    """Decode a stored mode-3 plane into ``out`` (uint8, its symbols).

    Raises:
        CorruptCheckpointError: the plane is malformed, or a block does not decode to exactly its symbols.
    """
    blocks, table = block_table(read_plane(stored, out.size), out.size)
    bad = decode_blocks(stored, out, blocks, table)
    if bad:
        raise CorruptCheckpointError(f"Huffman plane's block {bad - 1} does not decode to its symbols")


def _decode_numpy(src: np.ndarray, dst: np.ndarray, blocks: np.ndarray, tables: np.ndarray) -> int:
    """The NumPy decoder: every block a symbol at a time, side by side (a dozen array operations a step).

    A step reads 11 bits at each block's position, whatever lies there. That cannot change a valid
    block's symbols or any block's verdict: a code that ends within the block is the same whatever follows
    (no code is a prefix of another), and one that does not end within it leaves the block's position past
    its end, which the final check finds, as it finds a pattern that starts no code (length 0).
    """
    order = np.argsort(-(blocks[:, 3] & 0xFFFFFFFF), kind="stable")  # the longest blocks first
    pos, stop, at, meta = (blocks[order, i].copy() for i in range(4))
    table, count = (meta >> 32) << MAX_BITS, meta & 0xFFFFFFFF
    padded = np.zeros(src.size + 3, dtype=np.int64)
    padded[: src.size] = src
    words = padded[:-2] | padded[1:-1] << 8 | padded[2:] << 16  # the 24 bits from each byte on
    last_word = words.size - 1
    flat = tables.reshape(-1)
    good = np.ones(pos.size, dtype=np.bool_)
    done = 0
    for symbols in np.unique(count).tolist():  # the blocks still decoding decode symbols [done, symbols)
        n = int(np.count_nonzero(count >= symbols))
        p, first, codes, ok = pos[:n], at[:n], table[:n], good[:n]
        for i in range(done, symbols):
            window = (words[np.minimum(p >> 3, last_word)] >> (p & 7)) & ((1 << MAX_BITS) - 1)
            entry = flat[codes + window]
            length = entry >> 8
            dst[first + i] = entry.astype(np.uint8)
            ok &= length != 0
            p += length
        done = symbols
    good &= pos == stop
    return int(order[~good].min()) + 1 if not good.all() else 0


__all__ = ["BLOCK", "MAX_BITS", "PlaneAt", "StoredPlane", "block_rows", "block_table", "canonical_codes", "code_lengths",
           "coded_bound", "decode_blocks", "decode_into", "decode_table", "decode_tables", "encode", "encode_into", "encode_stream",
           "read_plane"]
