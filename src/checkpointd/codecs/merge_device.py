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

import numpy as np
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


@dataclass(frozen=True)
class Table:
    """Chunks to merge, checked against the sizes of their output and sources (:func:`table`): the kernel's
    rows with offsets where its addresses go, filled in by :func:`launch`."""

    rows: np.ndarray
    """Per chunk ROW int64: first tile, output offset, count, planes | rotated << 8, each plane's source offset."""
    source_of: np.ndarray
    """Per chunk and plane (8 columns), the source index; ``len(source_sizes)`` where unused (address 0)."""
    tiles: int
    out_size: int
    source_sizes: tuple[int, ...]


def table(chunks: list[Chunk], out_size: int, source_sizes: Sequence[int]) -> Table:
    """The rows of ``chunks`` for an output of ``out_size`` bytes and sources of ``source_sizes`` bytes;
    every range checked here. Made before the tensors exist (a restore makes it during the file's upload).

    Raises:
        ValueError: a range outside its output or source, or another number of planes than 1, 2, 4 or 8.
    """
    sizes = tuple(source_sizes)
    rows, source_of, tiles = [], [], 0
    for c in chunks:
        size = len(c.planes)
        if size not in (1, 2, 4, 8) or c.count < 0 or c.at < 0 or c.at + c.count * size > out_size or any(
                not 0 <= k < len(sizes) or off < 0 or off + c.count > sizes[k] for k, off in c.planes):
            raise ValueError(f"merge: {size} planes at {c.planes} of {c.count} bytes into byte {c.at} "
                             f"(output {out_size} bytes, sources {list(sizes)})")
        if c.count:
            rows.append([tiles, c.at, c.count, size | int(c.rotated) << 8, *[off for _, off in c.planes], *[0] * (8 - size)])
            source_of.append([k for k, _ in c.planes] + [len(sizes)] * (8 - size))
            tiles += -(-c.count // TILE)
    return Table(np.array(rows, dtype=np.int64).reshape(-1, ROW), np.array(source_of, dtype=np.int64).reshape(-1, 8),
                 tiles, out_size, sizes)


def launch(t: Table, out: torch.Tensor, sources: Sequence[torch.Tensor]) -> None:
    """Merge :func:`table`'s chunks into ``out`` from ``sources`` (uint8 tensors on one CUDA device, of the
    sizes the table was made for), queued on the current stream.

    Raises:
        ValueError: tensors of other sizes, types or devices.
    """
    device = out.device
    if any(t.dtype != torch.uint8 or t.device != device or t.dim() != 1 or not t.is_contiguous() for t in [out, *sources]):
        raise ValueError("merge: the output and every source must be contiguous 1-D uint8 tensors on one device")
    if out.numel() != t.out_size or tuple(s.numel() for s in sources) != t.source_sizes:
        raise ValueError(f"merge: a table for an output of {t.out_size} bytes and sources of {list(t.source_sizes)} "
                         f"given {out.numel()} and {[s.numel() for s in sources]}")
    if not t.tiles:
        return
    rows = t.rows.copy()
    rows[:, 1] += out.data_ptr()
    rows[:, 4:] += np.array([s.data_ptr() for s in sources] + [0], dtype=np.int64)[t.source_of]
    kernel = cuda_rtc.kernels(KERNEL_SOURCE, ["merge_planes"], device)["merge_planes"]
    kernel.launch(t.tiles, THREADS, [cuda_rtc.table_to(device, torch.from_numpy(rows)), ctypes.c_longlong(len(rows)),
                                     ctypes.c_longlong(TILE)])


def merge(out: torch.Tensor, sources: Sequence[torch.Tensor], chunks: list[Chunk]) -> None:
    """Write every chunk's elements into ``out``: byte ``j`` of element ``i`` is byte ``i`` of plane ``j``,
    rotated right by one bit where ``rotated``. ``out`` and ``sources`` are uint8 tensors on one CUDA
    device; 2, 4 or 8 planes a chunk, or 1: a copy (bytes a restore uploaded together, scattered to their
    places in the same launch). Every range is checked against its tensor here (:func:`table`, :func:`launch`).

    Raises:
        ValueError: a range outside its tensor, or another number of planes.
    """
    launch(table(chunks, out.numel(), [s.numel() for s in sources]), out, sources)


__all__ = ["Chunk", "KERNEL_SOURCE", "Table", "available", "launch", "merge", "table"]
