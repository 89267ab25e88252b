"""Merge a planes file's byte planes into whole elements on a GPU: one kernel for every chunk of a file.

Why: the planes of a chunk (the raw ones in the stored file on the device, the decoded exponents in the
Huffman kernel's output) must be interleaved back into elements and rotated back
(:func:`checkpointd.codecs.plane_kernels.from_planes` on the host). As torch operations that is a stack, a
few shifts and masks for the rotation and a copy out, each a pass over every byte of the state. This
kernel reads each plane byte once and writes each element once.

Safe by construction: every address it is given was checked on the host (a raw plane holds exactly
its chunk's count of bytes, :func:`checkpointd.codecs.planes.read_chunk_layout`; a decoded plane's place in
the decode buffer was laid out by the caller; an output range lies inside the file's native size), and
a thread touches only elements below its chunk's count.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Sequence

import torch

from checkpointd.native import cuda_rtc

KERNEL_SOURCE = r"""
/* rows: per chunk ROW int64: first tile, output address, element count, itemsize | rotated << 8,
 * then the address of each of its itemsize planes. */
#define ROW 12
template <typename T, int S>
__device__ void merge_tile(const long long* r, long long i0, long long end, bool rotated) {
    const unsigned char* p[S];
#pragma unroll
    for (int j = 0; j < S; ++j) p[j] = (const unsigned char*)r[4 + j];
    unsigned char* out = (unsigned char*)r[1];
    bool aligned = ((unsigned long long)out % S) == 0;
#pragma unroll 4
    for (long long i = i0 + threadIdx.x; i < end; i += blockDim.x) {
        T w = 0;
#pragma unroll
        for (int j = 0; j < S; ++j) w |= (T)p[j][i] << (8 * j);
        if (rotated) w = (w >> 1) | (w << (8 * S - 1));
        if (aligned) {
            ((T*)out)[i] = w;
        } else {
#pragma unroll
            for (int j = 0; j < S; ++j) out[i * S + j] = (unsigned char)(w >> (8 * j));
        }
    }
}

extern "C" __global__ void merge_planes(const long long* __restrict__ rows, long long n_rows, long long tile) {
    long long t = blockIdx.x, lo = 0, hi = n_rows - 1;
    while (lo < hi) { /* the last chunk whose first tile is at most t */
        long long mid = (lo + hi + 1) >> 1;
        if (rows[ROW * mid] <= t) lo = mid; else hi = mid - 1;
    }
    const long long* r = rows + ROW * lo;
    long long i0 = (t - r[0]) * tile, n = r[2];
    long long end = i0 + tile < n ? i0 + tile : n;
    int size = (int)(r[3] & 255);
    bool rotated = (r[3] >> 8) != 0;
    if (size == 1) merge_tile<unsigned char, 1>(r, i0, end, false);
    else if (size == 2) merge_tile<unsigned short, 2>(r, i0, end, rotated);
    else if (size == 4) merge_tile<unsigned int, 4>(r, i0, end, rotated);
    else if (size == 8) merge_tile<unsigned long long, 8>(r, i0, end, rotated);
}
"""
ROW = 12
THREADS = 256
TILE = 16 * THREADS
"""Elements per CUDA block."""


@dataclass
class Chunk:
    """One chunk to merge: ``count`` elements of ``len(planes)`` bytes at byte ``at`` of the output, plane
    ``j`` being ``count`` bytes at ``planes[j] = (source index, byte offset)`` of the sources."""

    at: int
    count: int
    planes: list[tuple[int, int]]
    rotated: bool


def available(device: torch.device) -> bool:
    """Whether the kernel runs on ``device`` (a CUDA device where it builds or loads; a failure is remembered
    and logged once, the caller then merges with torch operations)."""
    return cuda_rtc.kernels_available(KERNEL_SOURCE, ["merge_planes"], device,
                                      "plane merge kernel (planes merge with torch operations)")


def merge(out: torch.Tensor, sources: Sequence[torch.Tensor], chunks: list[Chunk]) -> None:
    """Write every chunk's elements into ``out``: byte ``j`` of element ``i`` is byte ``i`` of plane ``j``,
    rotated right by one bit where ``rotated``. ``out`` and ``sources`` are uint8 tensors on one CUDA
    device; 2, 4 or 8 planes a chunk, or 1: a copy (bytes a restore uploaded together, scattered to their
    places in the same launch). Every range is checked against its tensor here.

    Raises:
        ValueError: a range outside its tensor, or another number of planes.
    """
    device = out.device
    if any(t.dtype != torch.uint8 or t.device != device or t.dim() != 1 or not t.is_contiguous() for t in [out, *sources]):
        raise ValueError("merge: the output and every source must be contiguous 1-D uint8 tensors on one device")
    bases = [s.data_ptr() for s in sources]
    sizes = [s.numel() for s in sources]
    rows, tiles = [], 0
    for c in chunks:
        size = len(c.planes)
        if size not in (1, 2, 4, 8) or c.count < 0 or c.at < 0 or c.at + c.count * size > out.numel() or any(
                not 0 <= k < len(sources) or off < 0 or off + c.count > sizes[k] for k, off in c.planes):
            raise ValueError(f"merge: {size} planes at {c.planes} of {c.count} bytes into byte {c.at} "
                             f"(output {out.numel()} bytes, sources {sizes})")
        if c.count:
            rows.append([tiles, out.data_ptr() + c.at, c.count, size | int(c.rotated) << 8,
                         *[bases[k] + off for k, off in c.planes], *[0] * (8 - size)])
            tiles += -(-c.count // TILE)
    if not rows:
        return
    table = cuda_rtc.table_to(device, torch.tensor(rows, dtype=torch.int64))
    kernel = cuda_rtc.kernels(KERNEL_SOURCE, ["merge_planes"], device)["merge_planes"]
    kernel.launch(tiles, THREADS, [table, ctypes.c_longlong(len(rows)), ctypes.c_longlong(TILE)])


__all__ = ["Chunk", "KERNEL_SOURCE", "available", "merge"]
