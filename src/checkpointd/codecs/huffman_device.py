"""Decode Huffman-coded planes (:mod:`checkpointd.codecs.huffman`) where their bytes already are: on a GPU.

Why: a restore into CUDA tensors uploads each stored file to checksum it there
(:mod:`checkpointd.restore.device_image`); decoding its exponent planes on the host instead would cost
a pass over a quarter of the native bytes on the CPU and a second upload. Every block of every plane
is one GPU thread (``huffman_blocks`` in :data:`KERNEL_SOURCE`, built by
:mod:`checkpointd.native.cuda_rtc`): it finds its plane in one row per plane (all the host sends up), reads
its block's two ends from the plane's block table in the stored bytes, reads the block's bytes through a
64-bit window, looks each code up in the plane's 2048-entry table and writes its symbols, four at a time.

Safe on any input: the host checks every plane's header, code lengths and block ends first
(:func:`checkpointd.codecs.huffman.read_plane`); a thread reads only the bytes of its own block
(others read as zeros) and writes only its own block's symbols; a bit pattern that starts no code, a
code that runs past the block's end, or a block whose codes end short of it sets a flag that the
caller reads once, after the last launch. On CPU tensors the host decoder
(:func:`checkpointd.codecs.huffman.decode_blocks`) takes the rows the kernel makes (:func:`block_rows`), so
the CPU tests run the device path's plan.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from checkpointd.codecs import huffman
from checkpointd.codecs.huffman import HEADER, LENGTHS_NBYTES, PlaneAt, decode_blocks, decode_tables
from checkpointd.native import cuda_rtc


KERNEL_SOURCE = r"""
/* planes: per plane PLANE int64: where its block ends are in src (bytes), its blocks, its stream's first bit
 * in src, the stream's bits, where its symbols go in dst, its symbols, its block size, its decode table, its
 * first block among all planes' blocks. tables: 2048 uint16 per table, entry = code length << 8 | symbol. */
#define PLANE 9
__device__ long long block_end(const unsigned char* src, long long n_src, long long at, long long bits, bool* ok) {
    if (at < 0 || at > n_src - 4) {
        *ok = false;
        return 0;
    }
    long long end = (long long)src[at] | (long long)src[at + 1] << 8 | (long long)src[at + 2] << 16 |
                    (long long)src[at + 3] << 24;
    return end < bits ? end : bits;
}

extern "C" __global__ void huffman_blocks(const unsigned char* __restrict__ src, long long n_src,
                                          unsigned char* __restrict__ dst, const long long* __restrict__ planes,
                                          long long n_planes, const unsigned short* __restrict__ tables,
                                          long long n_blocks, unsigned char* __restrict__ bad) {
    long long b = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= n_blocks) return;
    long long lo = 0, hi = n_planes - 1;
    while (lo < hi) { /* the last plane whose first block is at most b */
        long long mid = (lo + hi + 1) >> 1;
        if (planes[PLANE * mid + 8] <= b) lo = mid; else hi = mid - 1;
    }
    const long long* p = planes + PLANE * lo;
    long long k = b - p[8];
    bool ok = k >= 0 && k < p[1];
    long long stop = ok ? block_end(src, n_src, p[0] + 4 * k, p[3], &ok) : 0;
    long long start = ok && k > 0 ? block_end(src, n_src, p[0] + 4 * (k - 1), p[3], &ok) : 0;
    if (!ok) {
        *bad = 1;
        return;
    }
    long long pos = p[2] + start;
    stop += p[2];
    long long at = p[4] + k * p[6], left = p[5] - k * p[6];
    int count = (int)(left < p[6] ? left : p[6]);
    const unsigned short* table = tables + p[7] * 2048;
    long long next = pos >> 3, last = (stop + 7) >> 3; /* the block's bytes: [pos / 8, last) */
    unsigned long long acc = 0;
    int have = 0;
    while (have <= 56) {
        acc |= (unsigned long long)(next < last ? src[next] : 0) << have;
        ++next;
        have += 8;
    }
    acc >>= pos & 7;
    have -= (int)(pos & 7);
    unsigned char* out = dst + at;
    bool words = (at & 3) == 0;
    unsigned int word = 0;
    for (int i = 0; i < count; ++i) {
        if (have < 11) {
            while (have <= 56) {
                acc |= (unsigned long long)(next < last ? src[next] : 0) << have;
                ++next;
                have += 8;
            }
        }
        unsigned short e = table[acc & 2047];
        int len = e >> 8;
        if (len == 0 || pos + len > stop) {
            *bad = 1;
            return;
        }
        acc >>= len;
        have -= len;
        pos += len;
        if (words) {
            word |= (unsigned int)(e & 255) << (8 * (i & 3));
            if ((i & 3) == 3) {
                *(unsigned int*)(out + i - 3) = word;
                word = 0;
            }
        } else {
            out[i] = (unsigned char)e;
        }
    }
    if (words) {
        for (int i = count & ~3; i < count; ++i) out[i] = (unsigned char)(word >> (8 * (i & 3)));
    }
    if (pos != stop) *bad = 1;
}
"""
THREADS = 128
"""Threads (blocks of a plane) per CUDA block."""


def available(device: torch.device) -> bool:
    """Whether planes can be decoded on ``device``: the kernel on a CUDA device (built or loaded on
    first call; a failure is remembered and logged once: the planes then decode on the host), the host
    decoder for CPU tensors."""
    return device.type == "cpu" or cuda_rtc.kernels_available(KERNEL_SOURCE, ["huffman_blocks"], device,
                                                              "Huffman kernel (its planes decode on the host)")


def decode(src: torch.Tensor, dst: torch.Tensor, planes: list[PlaneAt], bad: torch.Tensor,
           tables: PlaneTables | None = None) -> None:
    """Decode ``planes`` from ``src`` (the stored file, uint8) into ``dst`` (uint8), both on one device;
    a plane that does not decode sets ``bad`` (a bool on that device: read it after the last call).
    ``tables``: :func:`plane_tables` of ``planes``, made beforehand (else here).

    On a CUDA device this is one launch and two small copies up: no torch operation, whose kernels CUDA
    would load on their first use, in a resumed job's first restore."""
    if not planes:
        return
    per_plane, decode_table = tables if tables is not None else plane_tables(planes)
    if src.device.type != "cuda":  # the CPU: the host decoder on the rows the kernel makes, same contract
        bad |= decode_blocks(src.numpy(), dst.numpy(), block_rows(src.numpy(), per_plane), decode_table) != 0
        return
    if bad.dtype != torch.bool or bad.device != src.device:
        raise ValueError(f"decode: the damage flag must be a bool on {src.device}, not a {bad.dtype} on {bad.device}")
    kernel = cuda_rtc.kernels(KERNEL_SOURCE, ["huffman_blocks"], src.device)["huffman_blocks"]
    n = int(per_plane[:, 1].sum())
    if not n:
        return
    kernel.launch((n + THREADS - 1) // THREADS, THREADS, [
        src, ctypes.c_longlong(src.numel()), dst, cuda_rtc.table_to(src.device, torch.from_numpy(per_plane)),
        ctypes.c_longlong(per_plane.shape[0]), cuda_rtc.table_to(src.device, torch.from_numpy(decode_table.view(np.int16))),
        ctypes.c_longlong(n), bad])


PlaneTables = tuple[np.ndarray, np.ndarray]
"""What the host makes for :func:`decode` from the planes alone (:func:`plane_tables`)."""


def plane_tables(planes: list[PlaneAt]) -> PlaneTables:
    """The host's part of :func:`decode`: one row per plane (where its block ends and stream are, where its
    symbols go, its block size and decode table, its first block) and the decode tables of its distinct codes."""
    keys: dict[bytes, int] = {}
    per_plane = np.array([(p.src + HEADER.size + LENGTHS_NBYTES, p.plane.ends.size, 8 * (p.src + p.plane.stream[0]),
                           8 * (p.plane.stream[1] - p.plane.stream[0]), p.dst, p.count, p.plane.block,
                           keys.setdefault(p.plane.lengths.tobytes(), len(keys)), 0) for p in planes],
                         dtype=np.int64).reshape(-1, 9)
    per_plane[1:, 8] = np.cumsum(per_plane[:-1, 1])
    return per_plane, decode_tables(np.frombuffer(b"".join(keys), dtype=np.uint8)).reshape(-1)


def block_rows(src: np.ndarray, per_plane: np.ndarray) -> np.ndarray:
    """:func:`checkpointd.codecs.huffman.block_rows` of every plane, from their block ends in ``src``, as the
    kernel makes each for itself: each end clamped to its plane's stream (the host checked the same bytes,
    but only these are used), so a block never reaches past it whatever the ends say; ends out of order
    make blocks that cannot decode, which the decoders refuse."""
    out = [np.zeros((0, 4), dtype=np.int64)]
    for ends_at, blocks, base, bits, at, count, block, table, _ in per_plane.tolist():
        ends = np.minimum(src[ends_at : ends_at + 4 * blocks].view("<u4").astype(np.int64), bits)
        out.append(huffman.block_rows(ends, base, at, count, block, table))
    return np.ascontiguousarray(np.concatenate(out))


__all__ = ["KERNEL_SOURCE", "PlaneTables", "available", "block_rows", "decode", "plane_tables"]
