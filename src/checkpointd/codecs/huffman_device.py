"""Decode Huffman-coded planes (:mod:`checkpointd.codecs.huffman`) where their bytes already are: on a GPU.

Why: a restore into CUDA tensors uploads each stored file to checksum it there
(:mod:`checkpointd.restore.device_image`); decoding its exponent planes on the host instead would cost
a pass over a quarter of the native bytes on the CPU and a second upload. Every block of every plane
is one GPU thread (``huffman_blocks`` in :data:`KERNEL_SOURCE`, built by
:mod:`checkpointd.native.cuda_rtc`): it reads its block's bytes through a 64-bit window, looks each
code up in the plane's 2048-entry table and writes its symbols, four at a time.

Safe on any input: the host checks every plane's header, code lengths and block ends first
(:func:`checkpointd.codecs.huffman.read_plane`); a thread reads only the bytes of its own block
(others read as zeros) and writes only its own block's symbols; a bit pattern that starts no code, a
code that runs past the block's end, or a block whose codes end short of it sets a flag that the
caller reads once, after the last launch. On CPU tensors the host decoder takes the same block table
(:func:`checkpointd.codecs.huffman.decode_blocks`), so the CPU tests run the device path's plan.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from checkpointd.codecs.huffman import HEADER, LENGTHS_NBYTES, PlaneAt, decode_blocks, decode_tables
from checkpointd.native import cuda_rtc


KERNEL_SOURCE = r"""
/* blocks: per block four int64: first bit, end bit (both absolute in src), output offset in dst,
 * table index << 32 | symbols. tables: 2048 uint16 per plane, entry = code length << 8 | symbol. */
extern "C" __global__ void huffman_blocks(const unsigned char* __restrict__ src, unsigned char* __restrict__ dst,
                                          const long long* __restrict__ blocks,
                                          const unsigned short* __restrict__ tables, long long n_blocks,
                                          int* __restrict__ bad) {
    long long b = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= n_blocks) return;
    long long pos = blocks[4 * b], stop = blocks[4 * b + 1], at = blocks[4 * b + 2], meta = blocks[4 * b + 3];
    const unsigned short* table = tables + (meta >> 32) * 2048;
    int count = (int)(meta & 0xffffffffLL);
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
            atomicOr(bad, 1);
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
    if (pos != stop) atomicOr(bad, 1);
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
    ``tables``: :func:`plane_tables` of ``planes``, made beforehand (else here)."""
    if not planes:
        return
    per_plane, decode_table = tables if tables is not None else plane_tables(planes)
    blocks = _block_rows(src, per_plane)
    if src.device.type != "cuda":  # the CPU: the host decoder, same contract
        bad |= decode_blocks(src.numpy(), dst.numpy(), blocks.numpy(), decode_table) != 0
        return
    flag = torch.zeros(1, dtype=torch.int32, device=src.device)
    kernel = cuda_rtc.kernels(KERNEL_SOURCE, ["huffman_blocks"], src.device)["huffman_blocks"]
    n = blocks.shape[0]
    kernel.launch((n + THREADS - 1) // THREADS, THREADS, [src, dst, blocks,
                  cuda_rtc.table_to(src.device, torch.from_numpy(decode_table.view(np.int16))), ctypes.c_longlong(n), flag])
    bad |= flag[0] != 0


PlaneTables = tuple[np.ndarray, np.ndarray]
"""What the host makes for :func:`decode` from the planes alone (:func:`plane_tables`)."""


def plane_tables(planes: list[PlaneAt]) -> PlaneTables:
    """The host's part of :func:`decode`: one row per plane (where its block ends and stream are, where its
    symbols go, its block size and decode table) and the decode tables of its distinct codes."""
    keys: dict[bytes, int] = {}
    per_plane = np.array([(p.src + HEADER.size + LENGTHS_NBYTES, p.plane.ends.size, 8 * (p.src + p.plane.stream[0]),
                           8 * (p.plane.stream[1] - p.plane.stream[0]), p.dst, p.count, p.plane.block,
                           keys.setdefault(p.plane.lengths.tobytes(), len(keys))) for p in planes], dtype=np.int64)
    return per_plane, decode_tables(np.frombuffer(b"".join(keys), dtype=np.uint8)).reshape(-1)


def _block_rows(src: torch.Tensor, per_plane: np.ndarray) -> torch.Tensor:
    """:func:`checkpointd.codecs.huffman.block_table`'s rows, made where ``src`` is from its block ends there.

    A file's planes have ~1000 blocks each (600 thousand for 4.8 GB): making their rows on the host and
    uploading them cost 40-70 ms of a restore on an H200 host, a few torch operations on the device
    under one. Only one row per plane crosses (``per_plane``, :func:`plane_tables`). Each end is clamped
    to its plane's stream (the host checked the same bytes, but only these are used), so a block never
    reaches past it whatever the ends say; ends out of order make blocks that cannot decode, which the
    kernel refuses.
    """
    device = src.device
    ends_at, sizes, bit_base, total_bits, dst, count, block, table = cuda_rtc.table_to(
        device, torch.from_numpy(per_plane)).unbind(1)
    plane = torch.repeat_interleave(torch.arange(per_plane.shape[0], device=device), sizes,
                                    output_size=int(per_plane[:, 1].sum()))  # given: no wait for the device
    k = torch.arange(plane.numel(), device=device) - (torch.cumsum(sizes, 0) - sizes)[plane]
    at = ends_at[plane] + 4 * k
    end = src[at].long() | src[at + 1].long() << 8 | src[at + 2].long() << 16 | src[at + 3].long() << 24
    stop = torch.minimum(end, total_bits[plane])
    start = torch.where(k == 0, 0, torch.roll(stop, 1))
    base, size = bit_base[plane], block[plane]
    rows = torch.stack([base + start, base + stop, dst[plane] + k * size,
                        table[plane] << 32 | torch.minimum(size, count[plane] - k * size)], dim=1)
    return rows.contiguous()


__all__ = ["KERNEL_SOURCE", "PlaneTables", "available", "decode", "plane_tables"]
