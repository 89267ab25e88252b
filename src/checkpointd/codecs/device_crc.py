"""CRC-32 (zlib's) of bytes that are already on the GPU: a restore verifies a file where it is going.

Why: a verify-first restore that checksums on the host passes over host memory twice, one pass after
the other: the checksum of each mapped file on the CPU (page population ~23 ms + CRC-32 ~47 ms for
4.83 GB on a 16-core H200 host), then the copy into pinned chunks and their DMA (~90 ms). Uploading the
file first and checksumming the upload on the GPU drops the CPU pass: the same 4.83 GB take 3.3 ms on an
H200, and the bytes checked are exactly the bytes the live tensors are filled from.

How: the bytes are cut into lanes of :data:`LANE_BYTES`; one GPU thread computes a lane's CRC from a
zero state (slice-by-4 tables in shared memory, 16-byte loads: ``crc32_lanes`` in :data:`KERNEL_SOURCE`,
built by :mod:`checkpointd.native.cuda_rtc`; torch ops for the CPU tests and unaligned buffers, ~50x slower).
CRC-32 is linear over GF(2): with the lane CRCs ``c(A)``, ``c(B)`` of adjacent ranges, ``c(A + B) =
shift_len(B)(c(A)) ^ c(B)``, where the shift (feeding zero bytes) is a fixed 32x32 bit matrix applied as
four 256-entry tables. Zero lanes are prepended up to a power of two (leading zero bytes leave a
zero-started CRC unchanged), so the lanes are combined pairwise in ``log2(lanes)`` levels of one table
set each, on the GPU (``crc32_combine_level``, one launch a level). zlib's conditioning (start at
``0xFFFFFFFF``, invert at the end) and the bytes past the last whole lane (read on the host) are applied
last, on the CPU.

Used by restores that verify on the GPU (:mod:`checkpointd.restore.device_image`, the default into CUDA tensors).
"""

from __future__ import annotations

import ctypes
import functools
import threading
from typing import Any, Callable

import numpy as np
import torch

from checkpointd.codecs.crc import crc32, crc32_combine, crc32_combine_py
from checkpointd.native import cuda_rtc


LANE_BYTES = 4096
"""Bytes a GPU thread checksums; 4.83 GB make 1.18M lanes, 21 combining levels."""
_POLY = 0xEDB88320  # reflected CRC-32 polynomial


def _slice_tables() -> np.ndarray:
    """Slice-by-4 tables: ``t[0]`` the byte table, ``t[k][b] = (t[k-1][b] >> 8) ^ t[0][t[k-1][b] & 255]``."""
    t = np.zeros((4, 256), dtype=np.uint32)
    for b in range(256):
        c = b
        for _ in range(8):
            c = (c >> 1) ^ _POLY if c & 1 else c >> 1
        t[0, b] = c
    for k in range(1, 4):
        t[k] = (t[k - 1] >> 8) ^ t[0][t[k - 1] & 255]
    return t


SLICE_TABLES = _slice_tables()


def _apply(images: np.ndarray, v: np.ndarray) -> np.ndarray:
    """The GF(2)-linear map on uint32 whose unit vectors go to ``images``, applied to each of ``v``."""
    out = np.zeros_like(v)
    for j in range(32):
        out ^= np.where((v >> np.uint32(j)) & np.uint32(1), images[j], np.uint32(0))
    return out


def _zero_bytes_map(nbytes: int) -> np.ndarray:
    """Images of the 32 unit vectors under "feed ``nbytes`` zero bytes": multiplication by ``x^(8 nbytes)``
    modulo the polynomial, which is how :func:`checkpointd.codecs.crc.crc32_combine_py` shifts its first
    CRC (with a second CRC of 0 it is that shift alone)."""
    return np.array([crc32_combine_py(1 << j, 0, nbytes) for j in range(32)], dtype=np.uint32)


def _byte_tables(images: np.ndarray) -> np.ndarray:
    """``[4, 256]``: the map as ``t[0][c & 255] ^ t[1][(c >> 8) & 255] ^ t[2][(c >> 16) & 255] ^ t[3][c >> 24]``."""
    t = np.zeros((4, 256), dtype=np.uint32)
    for k in range(4):
        for j in range(8):
            t[k, 1 << j: 2 << j] = t[k, : 1 << j] ^ images[8 * k + j]
    return t


_tables_lock = threading.Lock()


def _level_tables(levels: int) -> np.ndarray:
    """``[levels, 4, 256]`` uint32: level ``k`` shifts past ``LANE_BYTES * 2**k`` zero bytes."""
    images = _zero_bytes_map(LANE_BYTES)
    out = np.zeros((levels, 4, 256), dtype=np.uint32)
    for k in range(levels):
        out[k] = _byte_tables(images)
        images = _apply(images, images)
    return out


LEVELS_BUILT = 24
"""Combining levels whose tables are built at the first use on a device, whatever the file: every file
up to ``2**24`` lanes (64 GiB) then slices them (a level's table depends on the level alone). Why: a
table per file size would cost each new size its own NumPy build, after that file's upload: in a fresh
process on an H200 host (4.83 GB in two files) the second file's CRC takes 6.7-7.0 ms that way, 2.5 ms
with the tables built once."""


def _combine_tables(levels: int, device: torch.device) -> torch.Tensor:
    """The first ``levels`` levels' tables as int64 on ``device`` (the torch-ops path), sliced from one
    build of :data:`LEVELS_BUILT` levels as the CUDA path's are (:func:`_tables_int32`)."""
    return _combine_tables_built(max(levels, LEVELS_BUILT), device)[:levels]


@functools.lru_cache(maxsize=None)
def _combine_tables_built(levels: int, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(_level_tables(levels).astype(np.int64)).to(device)


@functools.lru_cache(maxsize=None)
def _slice_tables_int64(device: torch.device) -> torch.Tensor:
    """:data:`SLICE_TABLES` as int64 on ``device`` (the torch-ops path)."""
    return torch.from_numpy(SLICE_TABLES.astype(np.int64)).to(device)


def _lanes_torch(words: torch.Tensor) -> torch.Tensor:
    """Zero-started CRC of each row of ``words`` (``[lanes, LANE_BYTES // 4]`` int32) with torch ops, as int64."""
    t = _slice_tables_int64(words.device)
    c = torch.zeros(words.shape[0], dtype=torch.int64, device=words.device)
    for k in range(words.shape[1]):
        x = c ^ (words[:, k].to(torch.int64) & 0xFFFFFFFF)
        c = t[3][x & 255] ^ t[2][(x >> 8) & 255] ^ t[1][(x >> 16) & 255] ^ t[0][(x >> 24) & 255]
    return c


KERNEL_SOURCE = r"""
#define LANE_BYTES %(lane)d
struct alignas(16) u4 { unsigned int x, y, z, w; };

__device__ __forceinline__ unsigned int step(unsigned int c, unsigned int w, const unsigned int (*t)[256]) {
    c ^= w;  /* slice-by-4: the four bytes of the word at once */
    return t[3][c & 255] ^ t[2][(c >> 8) & 255] ^ t[1][(c >> 16) & 255] ^ t[0][c >> 24];
}

/* out[lane] = zero-started CRC of bytes [lane * LANE_BYTES, (lane + 1) * LANE_BYTES) of data (16-byte aligned) */
extern "C" __global__ void crc32_lanes(const u4* __restrict__ data, unsigned int* __restrict__ out,
                                       const unsigned int* __restrict__ tab, long long n_lanes) {
    __shared__ unsigned int t[4][256];
    for (int i = threadIdx.x; i < 1024; i += blockDim.x) t[i >> 8][i & 255] = tab[i];
    __syncthreads();
    long long lane = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (lane >= n_lanes) return;
    const u4* p = data + lane * (LANE_BYTES / 16);
    unsigned int c = 0;
#pragma unroll 4
    for (int k = 0; k < LANE_BYTES / 16; ++k) {
        u4 v = p[k];
        c = step(c, v.x, t);
        c = step(c, v.y, t);
        c = step(c, v.z, t);
        c = step(c, v.w, t);
    }
    out[lane] = c;
}

/* out[i] = shift(in[2i]) ^ in[2i + 1]: tab holds this level's shift past in[2i + 1]'s bytes as four byte tables */
extern "C" __global__ void crc32_combine_level(const unsigned int* __restrict__ in, unsigned int* __restrict__ out,
                                               const unsigned int* __restrict__ tab, long long n_out) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_out) return;
    unsigned int a = in[2 * i], b = in[2 * i + 1];
    out[i] = tab[a & 255] ^ tab[256 + ((a >> 8) & 255)] ^ tab[512 + ((a >> 16) & 255)] ^ tab[768 + (a >> 24)] ^ b;
}
""" % {"lane": LANE_BYTES}
THREADS = 128
"""Threads (lanes) a block of the lane kernel runs."""



def _cuda_kernels(device: torch.device) -> dict[str, Any]:
    return cuda_rtc.kernels(KERNEL_SOURCE, ["crc32_lanes", "crc32_combine_level"], device)


def kernel_available(device: torch.device) -> bool:
    """Whether the CUDA kernels can run on ``device`` (built or loaded on first call; a failure is
    remembered, and logged once)."""
    return cuda_rtc.kernels_available(KERNEL_SOURCE, ["crc32_lanes", "crc32_combine_level"], device, "CRC-32 kernel")


def _tables_int32(levels: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The slice tables ``[1024]`` and the combining levels' tables ``[levels, 1024]`` as int32 on ``device``."""
    slice_tab, combine = _tables_int32_built(max(levels, LEVELS_BUILT), device)
    return slice_tab, combine[:levels]


@functools.lru_cache(maxsize=None)
def _tables_int32_built(levels: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.from_numpy(SLICE_TABLES.reshape(-1).view(np.int32).copy()).to(device),
            torch.from_numpy(_level_tables(levels).reshape(levels, 1024).view(np.int32).copy()).to(device))


def _raw_cuda_rows(bodies: list[tuple[torch.Tensor, int]]) -> list[torch.Tensor]:
    """The zero-started CRCs (int32 on the device, not waited for) of ``bodies``: ``(buffer, lanes)``
    pairs of at least one whole lane each, 16-byte aligned. One lane launch per buffer into rows of one
    array per power of two (each row that many lanes, zero lanes first: they leave a zero-started CRC
    unchanged); then each combining level is one launch for every row of the same length."""
    device = bodies[0][0].device
    k = _cuda_kernels(device)
    groups: dict[int, list[int]] = {}
    for i, (_, lanes) in enumerate(bodies):
        groups.setdefault((lanes - 1).bit_length(), []).append(i)
    raws: list[torch.Tensor] = [torch.empty(0)] * len(bodies)
    for levels, members in groups.items():
        with _tables_lock:
            slice_tab, combine_tab = _tables_int32(levels, device)
        width = 1 << levels
        c = torch.zeros(len(members) * width, dtype=torch.int32, device=device)
        for row, i in enumerate(members):
            body, n = bodies[i]
            k["crc32_lanes"].launch((n + THREADS - 1) // THREADS, THREADS,
                                    [body, c[(row + 1) * width - n : (row + 1) * width], slice_tab, ctypes.c_longlong(n)])
        for r in range(levels):
            n_out = c.numel() // 2
            nxt = torch.empty(n_out, dtype=torch.int32, device=device)
            k["crc32_combine_level"].launch((n_out + 255) // 256, 256, [c, nxt, combine_tab[r], ctypes.c_longlong(n_out)])
            c = nxt
        for row, i in enumerate(members):
            raws[i] = c[row : row + 1]
    return raws


def _finish(raw: int, body: int, tail: Any) -> int:
    """zlib's CRC-32 from the zero-started CRC of the first ``body`` bytes and the bytes after them."""
    crc = raw ^ crc32_combine_py(0xFFFFFFFF, 0, body) ^ 0xFFFFFFFF if body else 0  # zlib's start and end conditioning
    if len(tail):
        crc = crc32_combine(crc, crc32(tail), len(tail))
    return crc & 0xFFFFFFFF


def _raw_torch(words: torch.Tensor, lanes: int) -> int:
    """The same with torch ops (CPU tests, unaligned buffers): lanes, then the combining levels."""
    c = _lanes_torch(words)
    levels = (lanes - 1).bit_length()
    if (1 << levels) != lanes:
        c = torch.cat([torch.zeros((1 << levels) - lanes, dtype=torch.int64, device=c.device), c])
    if levels:
        with _tables_lock:
            tabs = _combine_tables(levels, c.device)
        for k in range(levels):
            pair = c.view(-1, 2)
            a, b = pair[:, 0], pair[:, 1]
            t = tabs[k]
            c = t[0][a & 255] ^ t[1][(a >> 8) & 255] ^ t[2][(a >> 16) & 255] ^ t[3][(a >> 24) & 255] ^ b
    return int(c.item())


def crc32_of(buf: torch.Tensor, host_tail: Any = None, use_kernel: bool | None = None) -> int:
    """zlib's CRC-32 of the bytes of ``buf`` (1-D uint8, on a GPU or the CPU; its start 4-byte aligned).

    ``host_tail``: the same bytes as ``buf`` past its last whole lane, readable on the host (a restore
    passes them from the mapped file; else they are copied back). ``use_kernel``: the CUDA kernels
    (default: on a CUDA device with a 16-byte aligned buffer), else torch ops (~20x slower).
    """
    return crc32_start(buf, host_tail, use_kernel)()


def crc32_start(buf: torch.Tensor, host_tail: Any = None, use_kernel: bool | None = None) -> Callable[[], int]:
    """:func:`crc32_of` in two halves: the device's work is queued on the current stream now, and the
    call returned waits for it and gives the CRC. Work queued on other streams in between does not
    delay the result (a restore queues a file's decoding there, :mod:`checkpointd.restore.device_image`)."""
    if buf.dim() != 1 or buf.dtype != torch.uint8:
        raise ValueError(f"crc32_of expects a 1-D uint8 tensor, got {buf.dtype} of shape {tuple(buf.shape)}")
    n = buf.numel()
    lanes = n // LANE_BYTES
    body = lanes * LANE_BYTES
    row: torch.Tensor | None = None  # the body's zero-started CRC, on the device, not waited for
    raw = 0
    if lanes:
        if buf.data_ptr() % 4:
            raise ValueError("crc32_of needs a 4-byte aligned buffer")
        if use_kernel is None:
            use_kernel = buf.device.type == "cuda" and buf.data_ptr() % 16 == 0
        if use_kernel:
            row = _raw_cuda_rows([(buf[:body], lanes)])[0]
        else:
            raw = _raw_torch(buf[:body].view(torch.int32).view(lanes, LANE_BYTES // 4), lanes)
    tail = host_tail if host_tail is not None else buf[body:].cpu().numpy().tobytes()
    if len(tail) != n - body:
        raise ValueError(f"host_tail has {len(tail)} bytes, expected {n - body}")

    def result() -> int:
        return _finish(int(row.item()) & 0xFFFFFFFF if row is not None else raw, body, tail)

    return result


def crc32_many(bufs: list[torch.Tensor]) -> list[int]:
    """:func:`crc32_of` of each of ``bufs`` (1-D uint8 on one device), with launches and waits shared.

    On a CUDA device, for 16-byte aligned buffers: :func:`_raw_cuda_rows`, then one copy brings the CRCs
    and the bytes past the last lanes back.
    A save that encodes its tensors on the GPU needs the CRC of each of them (a few hundred): one by
    one that is ~20 launches and a wait each.
    """
    if not bufs:
        return []
    device = bufs[0].device
    if device.type != "cuda" or any(b.data_ptr() % 16 or b.dim() != 1 or b.dtype != torch.uint8 or b.device != device
                                    for b in bufs) or not kernel_available(device):
        return [crc32_of(b) for b in bufs]
    lanes = [b.numel() // LANE_BYTES for b in bufs]
    whole = [i for i, n in enumerate(lanes) if n]
    raws = _raw_cuda_rows([(bufs[i], lanes[i]) for i in whole]) if whole else []
    tails = [b[n * LANE_BYTES :] for b, n in zip(bufs, lanes)]
    flat = torch.cat([r.view(torch.uint8) for r in raws] + tails).cpu().numpy()  # one wait for all
    raw = dict(zip(whole, (int(w) for w in flat[: 4 * len(whole)].view("<u4"))))
    out, pos = [], 4 * len(whole)
    for i, (b, n) in enumerate(zip(bufs, lanes)):
        size = b.numel() - n * LANE_BYTES
        out.append(_finish(raw.get(i, 0), n * LANE_BYTES, flat[pos : pos + size]))
        pos += size
    return out


def tail_start(nbytes: int) -> int:
    """Where the bytes past the last whole lane begin (what ``host_tail`` must hold from)."""
    return nbytes // LANE_BYTES * LANE_BYTES


__all__ = ["KERNEL_SOURCE", "LANE_BYTES", "crc32_many", "crc32_of", "crc32_start", "kernel_available", "tail_start"]
