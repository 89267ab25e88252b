"""The kernels of the device planes encoder (:mod:`checkpointd.codecs.encode_device`), and their host equivalents.

CUDA C compiled at run time (:mod:`checkpointd.native.cuda_rtc`), one launch per batch each:

- ``plane_histograms``: every element of a tile rotated left by one bit (the planes' transform) and
  each of its bytes counted in its plane's histogram (per-warp histograms in shared memory);
- ``raw_planes``: byte ``j`` of every rotated element written where plane ``j`` is stored raw;
- ``block_bits``: a warp sums the code lengths of one block of :data:`checkpointd.codecs.huffman.BLOCK`
  symbols; a cumulative sum (:func:`block_bounds`) gives each block's first and end bit;
- ``huffman_encode``: a thread writes one block's codes from its first bit, OR-ing only the words it
  shares with its neighbours. A block whose codes would run past its end or stop short of it sets a
  flag instead (its source changed since it was counted).

On CPU tensors :func:`to_planes`, NumPy and :func:`checkpointd.codecs.huffman`'s NumPy coder do the same
work from the same layout, so the CPU tests cover everything here but the CUDA code, which the GPU tests
compare with them byte for byte.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from checkpointd.codecs import huffman
from checkpointd.codecs.plane_kernels import to_planes
from checkpointd.native import cuda_rtc

KERNEL_SOURCE = r"""
__device__ __forceinline__ unsigned long long rotated(const unsigned char* p, int s) {
    if (s == 4) { unsigned int x = *(const unsigned int*)p; return (unsigned int)((x << 1) | (x >> 31)); }
    if (s == 2) { unsigned int x = *(const unsigned short*)p; return (unsigned short)((x << 1) | (x >> 15)); }
    unsigned long long x = *(const unsigned long long*)p;
    return (x << 1) | (x >> 63);
}

/* tiles: per tile TILE_ROW int64: source address, elements, itemsize, histogram row, then per plane the
 * address in out of its tile's first byte where the plane is stored raw (-1: not raw). */
#define TILE_ROW 12
extern "C" __global__ void plane_histograms(const long long* __restrict__ tiles, unsigned int* __restrict__ hist) {
    __shared__ unsigned int h[4][8 * 256];
    const long long* t = tiles + TILE_ROW * (long long)blockIdx.x;
    const unsigned char* src = (const unsigned char*)t[0];
    long long n = t[1];
    int s = (int)t[2], warp = threadIdx.x >> 5;
    for (int i = threadIdx.x; i < 4 * 8 * 256; i += blockDim.x) (&h[0][0])[i] = 0;
    __syncthreads();
    for (long long e = threadIdx.x; e < n; e += blockDim.x) {
        unsigned long long r = rotated(src + e * s, s);
        for (int j = 0; j < s; ++j) atomicAdd(&h[warp][j * 256 + ((r >> (8 * j)) & 255)], 1u);
    }
    __syncthreads();
    unsigned int* row = hist + t[3] * 256;
    for (int i = threadIdx.x; i < s * 256; i += blockDim.x) {
        unsigned int v = h[0][i] + h[1][i] + h[2][i] + h[3][i];
        if (v) atomicAdd(row + i, v);
    }
}

extern "C" __global__ void raw_planes(const long long* __restrict__ tiles, unsigned char* __restrict__ out) {
    const long long* t = tiles + TILE_ROW * (long long)blockIdx.x;
    const unsigned char* src = (const unsigned char*)t[0];
    long long n = t[1];
    int s = (int)t[2];
    for (long long e = threadIdx.x; e < n; e += blockDim.x) {
        unsigned long long r = rotated(src + e * s, s);
        for (int j = 0; j < s; ++j)
            if (t[4 + j] >= 0) out[t[4 + j] + e] = (unsigned char)(r >> (8 * j));
    }
}

/* blocks: per block 4 int64: address of its first element, symbols, itemsize | plane << 8, code row. */
extern "C" __global__ void block_bits(const long long* __restrict__ blocks, long long n_blocks,
                                      const unsigned char* __restrict__ lengths, long long* __restrict__ bits) {
    long long b = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (b >= n_blocks) return; /* whole warps: b is the same for every lane */
    const long long* r = blocks + 4 * b;
    const unsigned char* src = (const unsigned char*)r[0];
    long long n = r[1];
    int s = (int)(r[2] & 255), shift = 8 * (int)(r[2] >> 8);
    const unsigned char* len = lengths + 256 * r[3];
    long long sum = 0;
    for (long long e = lane; e < n; e += 32) sum += len[(rotated(src + e * s, s) >> shift) & 255];
    for (int o = 16; o; o >>= 1) sum += __shfl_down_sync(0xffffffffu, sum, o);
    if (lane == 0) bits[b] = sum;
}

/* first: per block its first and end bit, absolute in out (bit i is bit i % 8 of byte i / 8). */
extern "C" __global__ void huffman_encode(const long long* __restrict__ blocks, const long long* __restrict__ first,
                                          long long n_blocks, const unsigned short* __restrict__ codes,
                                          const unsigned char* __restrict__ lengths, unsigned char* out,
                                          int* __restrict__ bad) {
    long long b = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= n_blocks) return;
    const long long* r = blocks + 4 * b;
    const unsigned char* src = (const unsigned char*)r[0];
    long long n = r[1], bit = first[2 * b], stop = first[2 * b + 1];
    int s = (int)(r[2] & 255), shift = 8 * (int)(r[2] >> 8);
    const unsigned short* code = codes + 256 * r[3];
    const unsigned char* len = lengths + 256 * r[3];
    unsigned int* words = (unsigned int*)out;
    long long w = bit >> 5, end = bit;
    int have = (int)(bit & 31);
    unsigned long long acc = 0;
    bool edge = true; /* the first word may hold the previous block's bits, the last the next block's */
    for (long long e = 0; e < n; ++e) {
        int sym = (int)((rotated(src + e * s, s) >> shift) & 255);
        int l = len[sym];
        end += l;
        if (end > stop || l == 0) { atomicOr(bad, 1); return; }
        acc |= (unsigned long long)code[sym] << have;
        have += l;
        if (have >= 32) {
            if (edge) atomicOr(words + w, (unsigned int)acc); else words[w] = (unsigned int)acc;
            edge = false;
            ++w;
            acc >>= 32;
            have -= 32;
        }
    }
    if (end != stop) { atomicOr(bad, 1); return; }
    if (have > 0) atomicOr(words + w, (unsigned int)acc);
}
"""
NAMES = ["plane_histograms", "raw_planes", "block_bits", "huffman_encode"]
TILE_ELEMS = 1 << 16
"""Elements per CUDA block of the histogram and raw-plane kernels."""
_TILE_ROW = 12


@dataclass
class Chunk:
    record: Any
    """The ``encode_device.DeviceRecord`` the chunk is of."""
    start: int
    nbytes: int

    @property
    def itemsize(self) -> int:
        return self.record.itemsize

    @property
    def count(self) -> int:
        return self.nbytes // self.record.itemsize


@dataclass
class Layout:
    """Where a batch's frames go in its device buffer, and what the host writes there."""

    nbytes: int = 0
    frames: list[tuple[int, int]] = field(default_factory=list)  # (start, nbytes) per chunk; (-1, 0): skipped
    heads: list[tuple[int, bytes]] = field(default_factory=list)
    raw: dict[tuple[int, int], int] = field(default_factory=dict)  # (chunk, plane) -> offset of a raw plane
    huff: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    """Per Huffman plane: chunk, plane, stream offset, its code (in :attr:`codes`), stream bits."""
    codes: list[np.ndarray] = field(default_factory=list)
    """The code lengths of each code the batch's Huffman planes use (a tensor's chunks share theirs)."""


def histograms(batch: list[Chunk], device: torch.device) -> Callable[[], np.ndarray]:
    """Start counting the bytes of every plane of every chunk; the result gives them, ``(chunks, 8, 256)``.

    On a CUDA device the counting runs on a stream of its own and its result comes back as soon as it is
    done, so the next batch is counted while this one is coded."""
    if device.type == "cpu":
        counts = np.zeros((len(batch), 8, 256), dtype=np.int64)
        for i, c in enumerate(batch):
            for j, plane in enumerate(_host_planes(c)):
                counts[i, j] = np.bincount(plane, minlength=256)
        return lambda: counts
    side = stream_for(device, "counts")
    side.wait_stream(torch.cuda.current_stream(device))  # (the source is ready: the encoder's stream waited)
    with torch.cuda.stream(side):
        hist = torch.zeros(len(batch) * 8 * 256, dtype=torch.int32, device=device)
        tiles = _tiles(batch, {})
        if tiles.size:
            kernels(device)["plane_histograms"].launch(tiles.shape[0], 128,
                                                        [cuda_rtc.table_to(device, torch.from_numpy(tiles)), hist])
        host = torch.empty(hist.shape, dtype=torch.int32, pin_memory=True)
        host.copy_(hist, non_blocking=True)
        done = torch.cuda.Event(blocking=True)
        done.record(side)

    def result() -> np.ndarray:
        done.synchronize()
        return host.numpy().reshape(len(batch), 8, 256).astype(np.int64)

    return result


def _tiles(batch: list[Chunk], raw: dict[tuple[int, int], int]) -> np.ndarray:
    """The kernels' tile rows (``TILE_ROW`` in :data:`KERNEL_SOURCE`); ``raw``: (chunk, plane) -> offset in
    the batch's buffer of a plane stored raw."""
    base = np.array([c.record.data.data_ptr() + c.start for c in batch], dtype=np.int64)
    count = np.array([c.count for c in batch], dtype=np.int64)
    itemsize = np.array([c.itemsize for c in batch], dtype=np.int64)
    dst = np.full((len(batch), 8), -1, dtype=np.int64)
    for (i, j), at in raw.items():
        if j >= 0:
            dst[i, j] = at
    tiles = -(-count // TILE_ELEMS)
    chunk = np.repeat(np.arange(len(batch)), tiles)
    first = np.repeat(np.cumsum(tiles) - tiles, tiles)
    t = (np.arange(chunk.size, dtype=np.int64) - first) * TILE_ELEMS
    rows = np.empty((chunk.size, _TILE_ROW), dtype=np.int64)
    rows[:, 0] = base[chunk] + t * itemsize[chunk]
    rows[:, 1] = np.minimum(TILE_ELEMS, count[chunk] - t)
    rows[:, 2], rows[:, 3] = itemsize[chunk], 8 * chunk
    rows[:, 4:] = np.where(dst[chunk] >= 0, dst[chunk] + t[:, None], -1)
    return rows


def write_planes(batch: list[Chunk], layout: Layout, out: torch.Tensor, bad: torch.Tensor) -> None:
    """The raw planes, tails, block tables and Huffman streams of a laid-out batch, into ``out``."""
    device = out.device
    for (i, j), at in layout.raw.items():
        c = batch[i]
        if j < 0:  # bytes past the last whole element
            out[at : at + c.nbytes - c.count * c.itemsize] = c.record.data[c.start + c.count * c.itemsize : c.start + c.nbytes]
    if device.type == "cpu":
        bad |= _write_planes_host(batch, layout, out)
        return
    k = kernels(device)
    tiles = _tiles(batch, layout.raw)
    tiles = np.ascontiguousarray(tiles[(tiles[:, 4:] >= 0).any(axis=1)])
    if tiles.size:
        k["raw_planes"].launch(tiles.shape[0], 256, [cuda_rtc.table_to(device, torch.from_numpy(tiles)), out])
    if not layout.huff:
        return
    blocks, ends_at, first, stop, lengths, codes = _block_rows(batch, layout)
    n = blocks.shape[0]
    rows = cuda_rtc.table_to(device, torch.from_numpy(blocks))
    lengths_dev = cuda_rtc.table_to(device, torch.from_numpy(lengths))
    bits = torch.empty(n, dtype=torch.int64, device=device)
    k["block_bits"].launch((n * 32 + 255) // 256, 256, [rows, ctypes.c_longlong(n), lengths_dev, bits])
    bounds = block_bounds(bits, cuda_rtc.table_to(device, torch.from_numpy(np.stack([first, stop, ends_at], axis=1))),
                           out)
    k["huffman_encode"].launch((n + 127) // 128, 128, [rows, bounds, ctypes.c_longlong(n),
                                     cuda_rtc.table_to(device, torch.from_numpy(codes.view(np.int16))), lengths_dev,
                                     out, bad])


def _block_rows(batch: list[Chunk], layout: Layout) -> tuple[np.ndarray, ...]:
    """Per Huffman block: its kernel row, where its end goes, and its plane's first and last stream bit
    (repeated per block); the code lengths and codes of each of the layout's codes."""
    per_plane = np.array([(batch[i].record.data.data_ptr() + batch[i].start, batch[i].count, batch[i].itemsize | j << 8,
                           code, at, bits) for i, j, at, code, bits in layout.huff], dtype=np.int64).reshape(-1, 6)
    base, count, meta, code, at, bits = per_plane.T
    itemsize = meta & 255
    blocks = -(-count // huffman.BLOCK)
    plane = np.repeat(np.arange(per_plane.shape[0]), blocks)
    k = np.arange(plane.size, dtype=np.int64) - np.repeat(np.cumsum(blocks) - blocks, blocks)
    rows = np.stack([base[plane] + k * huffman.BLOCK * itemsize[plane],
                     np.minimum(huffman.BLOCK, count[plane] - k * huffman.BLOCK), meta[plane], code[plane]], axis=1)
    ends_at = at[plane] - 4 * blocks[plane] + 4 * k
    first, stop = 8 * at[plane], 8 * at[plane] + bits[plane]
    lengths = np.stack(layout.codes).astype(np.uint8)
    codes = np.stack([huffman.canonical_codes(c) for c in layout.codes])
    return np.ascontiguousarray(rows), ends_at, first, stop, np.ascontiguousarray(lengths), np.ascontiguousarray(codes)


def block_bounds(bits: torch.Tensor, plane_rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """From each block's bit count: every block's first and end bit (absolute in ``out``, ``(blocks, 2)``),
    and each block's end (relative to its plane's stream) written into its plane's block table.

    ``plane_rows``: per block, its plane's first stream bit, the bit where the host's counts end that
    stream, and where the block's end goes in ``out``. A plane's blocks are consecutive rows."""
    start, limit, ends_at = plane_rows.unbind(1)
    total = torch.cumsum(bits, 0)
    new_plane = torch.ones_like(start, dtype=torch.bool)
    new_plane[1:] = start[1:] != start[:-1]
    before = torch.where(new_plane, total - bits, torch.zeros_like(total))
    before = torch.cummax(before, 0).values  # each plane's bits before its first block
    end = total - before
    begin = end - bits
    for b in range(4):
        out[ends_at + b] = ((end >> (8 * b)) & 255).to(torch.uint8)
    # a plane whose blocks do not end where the host's counts do is refused by the kernel
    last = torch.ones_like(new_plane)
    last[:-1] = new_plane[1:]
    stop = torch.where(last, limit, start + end)
    return torch.stack([start + begin, torch.minimum(stop, limit)], dim=1).contiguous()


def _write_planes_host(batch: list[Chunk], layout: Layout, out: torch.Tensor) -> bool:
    """The host kernels: planes split by :func:`to_planes`, Huffman streams by the NumPy coder. True
    where a plane's codes do not end where the host's counts put them (the source changed)."""
    dst = out.numpy()
    split = {}
    for (i, j), at in layout.raw.items():
        if j >= 0:
            plane = split.setdefault(i, _host_planes(batch[i]))[j]
            dst[at : at + plane.size] = plane
    if not layout.huff:
        return False
    blocks, ends_at, first, stop, _lengths, codes = _block_rows(batch, layout)
    symbols = blocks[:, 1]
    lens = []
    for i, j, _at, code, _bits in layout.huff:
        plane = split.setdefault(i, _host_planes(batch[i]))[j]
        lens.append(layout.codes[code][plane].astype(np.int64))
    per_symbol = np.concatenate(lens)
    bits = np.add.reduceat(per_symbol, np.concatenate([[0], np.cumsum(symbols)[:-1]])) if symbols.size else symbols
    block_bounds(torch.from_numpy(bits), torch.from_numpy(np.stack([first, stop, ends_at], axis=1)), out)
    changed = False
    for i, j, at, code, nbits in layout.huff:
        plane = split[i][j]
        ends = np.empty(-(-plane.size // huffman.BLOCK), np.uint32)
        stream = huffman.encode_stream(plane, codes[code], layout.codes[code], ends)
        changed |= int(ends[-1]) != nbits
        dst[at : at + min(stream.size, (nbits + 7) // 8)] = stream[: (nbits + 7) // 8]
    return changed


def _host_planes(c: Chunk) -> np.ndarray:
    data = c.record.data[c.start : c.start + c.count * c.itemsize].numpy()
    return to_planes(memoryview(data), c.itemsize) if c.count else np.zeros((c.itemsize, 0), dtype=np.uint8)


_streams: dict[tuple[int, str], Any] = {}


def stream_for(device: torch.device, role: str = "codes") -> Any:
    """The codecs' own streams on ``device``, by role: the encoder's ``codes`` for the coding, ``counts``
    for the byte counts, ``copies`` for the copies to the host; a restore's ``decode``
    (:mod:`checkpointd.restore.device_decode`); None on the CPU. They have the lowest priority there is, which
    is also the default stream's: training's kernels interleave with the encoder's short ones."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if (index, role) not in _streams:
        _streams[(index, role)] = torch.cuda.Stream(torch.device("cuda", index), priority=0)
    return _streams[(index, role)]


def kernels(device: torch.device) -> dict[str, cuda_rtc.Kernel]:
    return cuda_rtc.kernels(KERNEL_SOURCE, NAMES, device)



__all__ = ["KERNEL_SOURCE", "NAMES", "TILE_ELEMS", "Chunk", "Layout", "block_bounds", "histograms", "kernels",
           "stream_for", "write_planes"]
