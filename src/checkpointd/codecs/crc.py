"""CRC-32 arithmetic: combine the CRCs of adjacent byte ranges without reading the bytes again.

Why: the parallel writer and reader checksum a file in pieces on many threads (``zlib.crc32`` releases
the GIL), and the manifest records one CRC-32 of the whole file; zip members need the CRC of their own
range too. ``crc32_combine(crc(A), crc(B), len(B)) == crc(A + B)`` gives both from the pieces.

zlib has ``crc32_combine`` in C, but Python's ``zlib`` module does not expose it; we call the system
``libz`` through ctypes when it loads, and otherwise use a pure-Python port of zlib's method
(multiplication by ``x^(8 * len2)`` modulo the CRC polynomial, with a table of ``x^(2^k)``), about
50 microseconds a call. Both are tested against ``zlib.crc32`` on random splits.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import zlib
from collections.abc import Callable, Iterable


def _fast_crc32() -> tuple[Callable[..., int], str]:
    """The fastest available ``crc32(data, value=0)`` with zlib's polynomial and results.

    zlib-ng (``pip install zlib-ng``) and ISA-L (``pip install isal``) use carry-less multiplication
    (PCLMUL): 15-20 GB/s a core where zlib's braided loop gives about 4 GB/s, which decides whether a
    checksum computed while writing is free on a machine with few cores.
    """
    try:
        from zlib_ng import zlib_ng  # type: ignore[import-not-found]

        if zlib_ng.crc32(b"123456789") == 0xCBF43926:
            return zlib_ng.crc32, "zlib-ng"
    except Exception:  # noqa: BLE001 - optional accelerator
        pass
    try:
        from isal import isal_zlib  # type: ignore[import-not-found]

        if isal_zlib.crc32(b"123456789") == 0xCBF43926:
            return isal_zlib.crc32, "isal"
    except Exception:  # noqa: BLE001 - optional accelerator
        pass
    return zlib.crc32, "zlib"


crc32: Callable[..., int]
crc32, CRC32_IMPLEMENTATION = _fast_crc32()
"""``crc32(data, value=0)``: same results as ``zlib.crc32``, from the fastest library installed."""

_POLY = 0xEDB88320  # reflected CRC-32 polynomial


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the CRC polynomial (reflected bit order), as zlib's ``multmodp``."""
    m = 1 << 31
    p = 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                break
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return p


def _make_x2n_table() -> list[int]:
    table = [0] * 32
    p = 1 << 30  # x^1
    table[0] = p
    for n in range(1, 32):
        p = _multmodp(p, p)
        table[n] = p
    return table


_X2N = _make_x2n_table()


def _x2nmodp(n: int, k: int) -> int:
    """x^(n * 2^k) modulo the polynomial."""
    p = 1 << 31  # x^0 == 1
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def crc32_combine_py(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of ``A + B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)`` (pure Python)."""
    if len2 <= 0:
        return crc1 & 0xFFFFFFFF if len2 == 0 else _bad_len(len2)
    return (_multmodp(_x2nmodp(len2, 3), crc1 & 0xFFFFFFFF) ^ crc2) & 0xFFFFFFFF


def _bad_len(len2: int) -> int:
    raise ValueError(f"crc32_combine: negative length {len2}")


def _load_libz() -> object | None:
    """zlib's ``crc32_combine64`` through ctypes, called with the GIL held (``PyDLL``).

    Why held: a combine takes well under a microsecond, and a ``CDLL`` call drops and retakes the GIL.
    A save combines about a thousand CRCs per file on the writer's threads; with a training thread that
    wants the GIL all the time (a launch-bound loop), every retake is a forced switch away from it.
    """
    for name in (ctypes.util.find_library("z"), "libz.so.1", "libz.dylib"):
        if not name:
            continue
        try:
            lib = ctypes.PyDLL(name)
            fn = lib.crc32_combine64
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_ulong
        fn.argtypes = [ctypes.c_ulong, ctypes.c_ulong, ctypes.c_int64]
        return fn
    return None


_libz_combine = _load_libz()


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of ``A + B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)``."""
    if len2 <= 0:
        return crc1 & 0xFFFFFFFF if len2 == 0 else _bad_len(len2)
    if _libz_combine is not None:
        return int(_libz_combine(crc1 & 0xFFFFFFFF, crc2 & 0xFFFFFFFF, len2)) & 0xFFFFFFFF  # type: ignore[operator]
    return crc32_combine_py(crc1, crc2, len2)


def crc32_concat(parts: Iterable[tuple[int, int]], crc: int = 0) -> int:
    """CRC-32 of consecutive ranges given as ``(crc, length)`` in order, continuing from ``crc``."""
    for part_crc, length in parts:
        crc = crc32_combine(crc, part_crc, length)
    return crc


__all__ = ["CRC32_IMPLEMENTATION", "crc32", "crc32_combine", "crc32_combine_py", "crc32_concat"]
