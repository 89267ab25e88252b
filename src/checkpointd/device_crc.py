"""CRC-32 (zlib's) of bytes that are already on the GPU: a restore verifies a file where it is going.

Why: a verify-first restore used to pass over host memory twice, one pass after the other: the
checksum of each mapped file on the CPU (page population ~23 ms + CRC-32 ~47 ms for 4.83 GB on a
16-core H200 host), then the copy into pinned chunks and their DMA (~90 ms). Uploading the file first
and checksumming the upload on the GPU drops the CPU pass: the same 4.83 GB take 8.3-8.5 ms here
(RESULTS.md, session 29), and the bytes checked are exactly the bytes the live tensors are filled from.

How: the bytes are cut into lanes of :data:`LANE_BYTES`; one GPU thread computes a lane's CRC from a
zero state (slice-by-4 tables, a Triton kernel; torch ops where Triton is missing, ~20x slower, used by
the CPU tests). CRC-32 is linear over GF(2): with the lane CRCs ``c(A)``, ``c(B)`` of adjacent ranges,
``c(A + B) = shift_len(B)(c(A)) ^ c(B)``, where the shift (feeding zero bytes) is a fixed 32x32 bit
matrix applied as four 256-entry tables. Zero lanes are prepended up to a power of two (leading zero
bytes leave a zero-started CRC unchanged), so the lanes are combined pairwise in ``log2(lanes)`` rounds
of one table set each, on the GPU. zlib's conditioning (start at ``0xFFFFFFFF``, invert at the end) and
the bytes past the last whole lane (read on the host) are applied last, on the CPU.

Used by restores that verify on the GPU (opt-in: :mod:`checkpointd.device_image`).
"""

from __future__ import annotations

import functools
import importlib
import threading
from typing import Any

import numpy as np
import torch

from .crc import _multmodp, _x2nmodp, crc32, crc32_combine, crc32_combine_py

LANE_BYTES = 4096
"""Bytes a GPU thread checksums; 4.83 GB make 1.18M lanes, 21 combining rounds."""
BLOCK = 128
"""Lanes a Triton program runs (64 took 14.7 ms for 4.83 GB on an H200, 128 8.3 ms, 256 23.4 ms)."""
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
    modulo the polynomial, as :func:`checkpointd.crc.crc32_combine_py` shifts a CRC."""
    power = _x2nmodp(nbytes, 3)
    return np.array([_multmodp(power, 1 << j) for j in range(32)], dtype=np.uint32)


def _byte_tables(images: np.ndarray) -> np.ndarray:
    """``[4, 256]``: the map as ``t[0][c & 255] ^ t[1][(c >> 8) & 255] ^ t[2][(c >> 16) & 255] ^ t[3][c >> 24]``."""
    t = np.zeros((4, 256), dtype=np.uint32)
    for k in range(4):
        for j in range(8):
            t[k, 1 << j: 2 << j] = t[k, : 1 << j] ^ images[8 * k + j]
    return t


_tables_lock = threading.Lock()


@functools.lru_cache(maxsize=None)
def _combine_tables(levels: int, device: torch.device) -> torch.Tensor:
    """``[levels, 4, 256]`` int64 on ``device``: round ``k`` shifts past ``LANE_BYTES * 2**k`` zero bytes."""
    images = _zero_bytes_map(LANE_BYTES)
    out = []
    for _ in range(levels):
        out.append(_byte_tables(images))
        images = _apply(images, images)
    return torch.from_numpy(np.stack(out).astype(np.int64)).to(device)


@functools.lru_cache(maxsize=None)
def _slice_tables_on(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(SLICE_TABLES.view(np.int32).astype(np.int64) & 0xFFFFFFFF).to(device=device, dtype=dtype)


def _lanes_torch(words: torch.Tensor) -> torch.Tensor:
    """Zero-started CRC of each row of ``words`` (``[lanes, LANE_BYTES // 4]`` int32) with torch ops, as int64."""
    t = _slice_tables_on(words.device, torch.int64)
    c = torch.zeros(words.shape[0], dtype=torch.int64, device=words.device)
    for k in range(words.shape[1]):
        x = c ^ (words[:, k].to(torch.int64) & 0xFFFFFFFF)
        c = t[3][x & 255] ^ t[2][(x >> 8) & 255] ^ t[1][(x >> 16) & 255] ^ t[0][(x >> 24) & 255]
    return c


_kernel: Any = None
_kernel_lock = threading.Lock()


def triton_available() -> bool:
    """Whether the Triton kernel can run (Triton importable; it compiles for the GPU on first use)."""
    try:
        importlib.import_module("triton.language")
    except Exception:  # noqa: BLE001 - missing, or broken for this platform
        return False
    return True


def _triton_kernel() -> Any:
    global _kernel
    with _kernel_lock:
        if _kernel is None:
            import triton
            import triton.language as tl

            @triton.jit
            def crc_lanes(data, out, tab, n_lanes, WORDS: tl.constexpr, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
                lanes = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
                mask = lanes < n_lanes
                base = lanes.to(tl.int64) * WORDS
                c = tl.zeros([BLOCK], dtype=tl.uint32)
                for k in range(WORDS):
                    w = tl.load(data + base + k, mask=mask, other=0).to(tl.uint32, bitcast=True)
                    x = c ^ w
                    i0 = (x & 255).to(tl.int32)
                    i1 = ((x >> 8) & 255).to(tl.int32)
                    i2 = ((x >> 16) & 255).to(tl.int32)
                    i3 = (x >> 24).to(tl.int32)
                    c = (tl.load(tab + 768 + i0).to(tl.uint32, bitcast=True) ^ tl.load(tab + 512 + i1).to(tl.uint32, bitcast=True)
                         ^ tl.load(tab + 256 + i2).to(tl.uint32, bitcast=True) ^ tl.load(tab + i3).to(tl.uint32, bitcast=True))
                tl.store(out + lanes, c.to(tl.int32, bitcast=True), mask=mask)

            _kernel = crc_lanes
        return _kernel


def _lanes_triton(words: torch.Tensor) -> torch.Tensor:
    import triton

    tab = _slice_tables_on(words.device, torch.int32).reshape(-1)
    n = words.shape[0]
    out = torch.empty(n, dtype=torch.int32, device=words.device)
    _triton_kernel()[(triton.cdiv(n, BLOCK),)](words, out, tab, n, WORDS=words.shape[1], BLOCK=BLOCK)
    return out.to(torch.int64) & 0xFFFFFFFF


def crc32_of(buf: torch.Tensor, host_tail: Any = None, use_triton: bool | None = None) -> int:
    """zlib's CRC-32 of the bytes of ``buf`` (1-D uint8, on a GPU or the CPU; its start 4-byte aligned).

    ``host_tail``: the same bytes as ``buf`` past its last whole lane, readable on the host (a restore
    passes them from the mapped file; else they are copied back). ``use_triton``: default, on CUDA.
    """
    if buf.dim() != 1 or buf.dtype != torch.uint8:
        raise ValueError(f"crc32_of expects a 1-D uint8 tensor, got {buf.dtype} of shape {tuple(buf.shape)}")
    n = buf.numel()
    lanes = n // LANE_BYTES
    body = lanes * LANE_BYTES
    crc = 0
    if lanes:
        if buf.data_ptr() % 4:
            raise ValueError("crc32_of needs a 4-byte aligned buffer")
        words = buf[:body].view(torch.int32).view(lanes, LANE_BYTES // 4)
        tri = buf.device.type == "cuda" if use_triton is None else use_triton
        c = _lanes_triton(words) if tri else _lanes_torch(words)
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
        raw = int(c.item())
        crc = raw ^ crc32_combine_py(0xFFFFFFFF, 0, body) ^ 0xFFFFFFFF  # zlib's start and end conditioning
    tail = host_tail if host_tail is not None else buf[body:].cpu().numpy().tobytes()
    if len(tail) != n - body:
        raise ValueError(f"host_tail has {len(tail)} bytes, expected {n - body}")
    if len(tail):
        crc = crc32_combine(crc, crc32(tail), len(tail))
    return crc & 0xFFFFFFFF


def tail_start(nbytes: int) -> int:
    """Where the bytes past the last whole lane begin (what ``host_tail`` must hold from)."""
    return nbytes // LANE_BYTES * LANE_BYTES


__all__ = ["BLOCK", "LANE_BYTES", "crc32_of", "tail_start", "triton_available"]
