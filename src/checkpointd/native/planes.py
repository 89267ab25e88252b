"""Optional native kernels for the byte-plane codec: the C library built at install, NumPy without it.

Why: decoding a ``zstd-planes`` chunk in NumPy takes about ten passes over it (unpack the nibble
codes, add their base, put escapes back, widen, shift, OR the planes together, rotate back), each a
call that drops and retakes the GIL. On a 16-core host 16 codec threads decode bf16 at 5.4-8.2 GB/s
that way, below plain zstd (7.6) although the planes give zstd less to do. ``planes_native.c`` does
the same work in one pass over cache-sized blocks, called through :mod:`ctypes` (which releases the
GIL for the call). Its results are the same bytes; the tests compare both implementations.

How: ``pip install`` compiles ``planes_native.c`` (an optional extension of ``setup.py``) and
:mod:`checkpointd.native.loader` loads it. Where it is not built, or native code is turned off
(:func:`checkpointd.options.native_enabled`), the NumPy kernels run (logged once): slower, same bytes.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from checkpointd.native.loader import NativeLibrary

ABI = 7
"""``cpd_abi()`` of the C source this module expects."""


def declare(lib: Any) -> None:
    """Declare the ctypes signatures of the library's functions."""
    i64, i32 = ctypes.c_int64, ctypes.c_int32
    lib.cpd_decode_planes.restype = i64
    lib.cpd_decode_planes.argtypes = [i32, i64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                      ctypes.c_void_p, ctypes.c_void_p, i32, ctypes.c_void_p]
    lib.cpd_split_planes.restype = i64
    lib.cpd_split_planes.argtypes = [i32, i64, ctypes.c_void_p, ctypes.c_void_p]
    lib.cpd_encode_planes.restype = i64
    lib.cpd_encode_planes.argtypes = [i32, i64, ctypes.c_void_p, ctypes.c_void_p, i64, ctypes.c_void_p,
                                      ctypes.c_void_p, i64, ctypes.c_void_p, ctypes.c_void_p]
    lib.cpd_sample_entropy.restype = None
    lib.cpd_sample_entropy.argtypes = [i32, i64, ctypes.c_void_p, ctypes.c_void_p]
    lib.cpd_histogram.restype = None
    lib.cpd_histogram.argtypes = [ctypes.c_void_p, i64, ctypes.c_void_p]
    lib.cpd_huffman_encode.restype = i64
    lib.cpd_huffman_encode.argtypes = [ctypes.c_void_p, i64, ctypes.c_void_p, ctypes.c_void_p, i64, ctypes.c_void_p,
                                       ctypes.c_void_p, i64]
    lib.cpd_code_lengths.restype = None
    lib.cpd_code_lengths.argtypes = [ctypes.c_void_p, i32, ctypes.c_void_p]
    lib.cpd_huffman_blocks.restype = i64
    lib.cpd_huffman_blocks.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, i64, ctypes.c_void_p]


LIBRARY = NativeLibrary("planes_native", ("cpd_abi", ABI), declare, "native plane kernels",
                        "zstd-planes uses NumPy (same files, about half the speed)")
"""The built ``planes_native.c``."""

library = LIBRARY.get
"""The loaded library, or None (NumPy kernels); loaded on the first call."""
reset = LIBRARY.reset
"""Forget the loaded state so the next :func:`library` call decides again (tests)."""


__getattr__ = LIBRARY.module_getattr(__name__)
"""``why_not``: why the native kernels are not in use ("" when they are, or before the first try)."""


def address(buf: Any) -> int:
    """Address of a contiguous buffer (NumPy array, bytes, memoryview, mmap slice), read-only ones too."""
    arr = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, dtype=np.uint8)
    return int(arr.ctypes.data)


def decode_planes(lib: Any, planes: list[tuple[int, Any, int, Any, int]], count: int, rotated: bool,
                  out: np.ndarray) -> int:
    """Merge planes into ``out`` (``count`` elements). ``planes[j]``: (mode, data, base, escapes, n_escapes).

    Mode 0: ``data`` is the plane's ``count`` bytes; mode 1: its nibble codes (``ceil(count / 2)``
    bytes), ``escapes`` the escaped values. Returns 0, or ``j + 1`` if plane ``j``'s escapes do not
    number ``n_escapes``. Every buffer must stay alive during the call (the caller holds them).
    """
    n = len(planes)
    data = (ctypes.c_void_p * n)(*[address(p[1]) for p in planes])
    modes = (ctypes.c_int32 * n)(*[p[0] for p in planes])
    bases = (ctypes.c_int32 * n)(*[p[2] for p in planes])
    escapes = (ctypes.c_void_p * n)(*[address(p[3]) if p[4] else 0 for p in planes])
    counts = (ctypes.c_int64 * n)(*[p[4] for p in planes])
    assert out.flags.c_contiguous and out.nbytes >= count * n
    result = lib.cpd_decode_planes(n, count, data, modes, bases, escapes, counts, int(rotated), out.ctypes.data)
    if result < 0:
        raise ValueError(f"cpd_decode_planes refused itemsize {n} / modes {[p[0] for p in planes]}")
    return int(result)


def split_planes(lib: Any, view: Any, itemsize: int, count: int, planes: np.ndarray) -> None:
    """Rotated byte planes of ``count`` elements of ``view`` into ``planes`` (shape ``(itemsize, >= count)``)."""
    rows = (ctypes.c_void_p * itemsize)(*[int(planes[j].ctypes.data) for j in range(itemsize)])
    if lib.cpd_split_planes(itemsize, count, address(view), rows) < 0:
        raise ValueError(f"cpd_split_planes refused itemsize {itemsize}")


def encode_planes(lib: Any, view: Any, itemsize: int, count: int, worth: list[bool], block: int, out: np.ndarray,
                  scratch: np.ndarray) -> tuple[int, list[int], list[int]]:
    """The planes of ``count`` elements of ``view``, stored from ``out[0]`` (uint8, ``itemsize * count``
    bytes): plane j Huffman-coded where ``worth[j]`` and smaller, else raw (``scratch``: uint8, room for
    one coded plane). Returns the stored bytes, each plane's mode and stored size."""
    flags = np.array(worth, dtype=np.uint8)
    modes = np.zeros(itemsize, dtype=np.uint8)
    stored = np.zeros(itemsize, dtype=np.int64)
    total = lib.cpd_encode_planes(itemsize, count, address(view), flags.ctypes.data, block, out.ctypes.data,
                                  scratch.ctypes.data, scratch.nbytes, modes.ctypes.data, stored.ctypes.data)
    if total < 0:
        raise ValueError(f"cpd_encode_planes refused itemsize {itemsize} or a scratch of {scratch.nbytes} bytes")
    return int(total), modes.tolist(), stored.tolist()


def sample_entropy(lib: Any, sample: Any, itemsize: int) -> list[float]:
    """Entropy, in bits per byte, of each rotated byte plane of the elements in ``sample`` (itemsize 2, 4 or 8)."""
    bits = np.zeros(itemsize, dtype=np.float64)
    lib.cpd_sample_entropy(itemsize, memoryview(sample).nbytes // itemsize, address(sample), bits.ctypes.data)
    return bits.tolist()


def histogram(lib: Any, plane: np.ndarray) -> np.ndarray:
    """How often each byte value occurs in ``plane`` (256 int64 counts)."""
    counts = np.zeros(256, dtype=np.int64)
    lib.cpd_histogram(address(plane), plane.size, counts.ctypes.data)
    return counts


def code_lengths(lib: Any, counts: np.ndarray, max_bits: int) -> np.ndarray:
    """``huffman.code_lengths`` of 256 byte counts, in C (uint8, 256)."""
    c = np.ascontiguousarray(counts, dtype=np.int64)
    if c.shape != (256,):
        raise ValueError(f"code lengths take 256 counts, got shape {c.shape}")
    lengths = np.empty(256, dtype=np.uint8)
    lib.cpd_code_lengths(c.ctypes.data, max_bits, lengths.ctypes.data)
    return lengths


def huffman_encode(lib: Any, plane: np.ndarray, codes: np.ndarray, lengths: np.ndarray, block: int,
                   ends: np.ndarray, out: np.ndarray) -> int:
    """Bit stream of ``plane`` into ``out``, block ends into ``ends`` (uint32); its bytes, or -1 past ``out``.
    Every byte value in ``plane`` must have a code (``lengths`` made from its histogram)."""
    return int(lib.cpd_huffman_encode(address(plane), plane.size, codes.ctypes.data, lengths.ctypes.data, block,
                                      ends.ctypes.data, out.ctypes.data, out.nbytes))


def huffman_blocks(lib: Any, src: Any, dst: np.ndarray, blocks: np.ndarray, tables: np.ndarray) -> int:
    """Decode Huffman blocks (:func:`checkpointd.codecs.huffman.block_table`) from ``src`` into ``dst``;
    0, or ``k + 1`` for a block ``k`` that does not decode."""
    assert blocks.dtype == np.int64 and blocks.flags.c_contiguous and tables.dtype == np.uint16
    return int(lib.cpd_huffman_blocks(address(src), dst.ctypes.data, blocks.ctypes.data, blocks.shape[0],
                                      tables.ctypes.data))
