"""CRC-32 arithmetic: checksum bytes, and combine the CRCs of adjacent byte ranges without reading them again.

Why combine: the parallel writer and reader checksum a file in pieces on many threads (the CRC functions
release the GIL on large buffers), and the manifest records one CRC-32 of the whole file; zip members need
the CRC of their own range too. ``crc32_combine(crc(A), crc(B), len(B)) == crc(A + B)`` gives both from the
pieces.

Both come from zlib-ng (the ``zlib-ng`` package, a dependency): its CRC-32 uses carry-less multiplication
(PCLMUL) at 15-20 GB/s a core where zlib's braided loop gives about 4 GB/s, which decides whether a
checksum computed while writing is free on a machine with few cores; its ``crc32_combine`` takes about
1 microsecond and holds the GIL (a save combines about a thousand CRCs a file on the writer's threads,
and a training thread that wants the GIL all the time pays for every switch away from it). Where zlib-ng
cannot be imported, ISA-L's or zlib's CRC-32 and :func:`crc32_combine_py` (a pure-Python port of zlib's
method, about 40 microseconds a call) give the same results. Both combines are tested against
``zlib.crc32`` on random splits.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable

CHECK_INPUT = b"123456789"
CHECK_VALUE = 0xCBF43926
"""CRC-32 of :data:`CHECK_INPUT`: an accelerator that gives another value is not used."""


def fast_crc32() -> tuple[Callable[..., int], str]:
    """The fastest available ``crc32(data, value=0)`` with zlib's polynomial and results, and its name.

    zlib-ng (a dependency) first, then ISA-L (``pip install isal``), then zlib's."""
    try:
        from zlib_ng import zlib_ng  # type: ignore[import-not-found]

        if zlib_ng.crc32(CHECK_INPUT) == CHECK_VALUE:
            return zlib_ng.crc32, "zlib-ng"
    except Exception:  # noqa: BLE001 - optional accelerator
        pass
    try:
        from isal import isal_zlib  # type: ignore[import-not-found]

        if isal_zlib.crc32(CHECK_INPUT) == CHECK_VALUE:
            return isal_zlib.crc32, "isal"
    except Exception:  # noqa: BLE001 - optional accelerator
        pass
    return zlib.crc32, "zlib"


def fast_crc32_combine() -> Callable[[int, int, int], int] | None:
    """zlib-ng's ``crc32_combine(crc1, crc2, len2)`` (checked on :data:`CHECK_INPUT`), or None without it."""
    try:
        from zlib_ng import zlib_ng  # type: ignore[import-not-found]

        combine: Callable[[int, int, int], int] = zlib_ng.crc32_combine
        if combine(zlib.crc32(CHECK_INPUT[:4]), zlib.crc32(CHECK_INPUT[4:]), len(CHECK_INPUT) - 4) == CHECK_VALUE:
            return combine
    except Exception:  # noqa: BLE001 - optional accelerator
        pass
    return None


crc32: Callable[..., int]
crc32, CRC32_IMPLEMENTATION = fast_crc32()
"""``crc32(data, value=0)``: same results as ``zlib.crc32``, from the fastest library installed."""

COMBINE: Callable[[int, int, int], int] | None = fast_crc32_combine()
"""zlib-ng's combine, used by :func:`crc32_combine`; None: :func:`crc32_combine_py` runs instead (tests set it)."""

POLY = 0xEDB88320
"""The CRC-32 polynomial, reflected bit order."""


def multmodp(a: int, b: int) -> int:
    """a * b modulo the CRC polynomial (reflected bit order), as zlib's ``multmodp``."""
    m = 1 << 31
    p = 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                break
        m >>= 1
        b = (b >> 1) ^ POLY if b & 1 else b >> 1
    return p


def make_x2n_table() -> list[int]:
    """``x^(2^k)`` modulo the polynomial for k < 32, as zlib's ``x2n_table``."""
    table = [0] * 32
    p = 1 << 30  # x^1
    table[0] = p
    for n in range(1, 32):
        p = multmodp(p, p)
        table[n] = p
    return table


X2N = make_x2n_table()
"""``x^(2^k)`` modulo the polynomial, for k < 32."""


def x2nmodp(n: int, k: int) -> int:
    """x^(n * 2^k) modulo the polynomial."""
    p = 1 << 31  # x^0 == 1
    while n:
        if n & 1:
            p = multmodp(X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def refuse_negative(len2: int) -> int:
    """Raise the error for a negative second length."""
    raise ValueError(f"crc32_combine: negative length {len2}")


def crc32_combine_py(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of ``A + B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)`` (pure Python)."""
    if len2 <= 0:
        return crc1 & 0xFFFFFFFF if len2 == 0 else refuse_negative(len2)
    return (multmodp(x2nmodp(len2, 3), crc1 & 0xFFFFFFFF) ^ crc2) & 0xFFFFFFFF


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of ``A + B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)`` (zlib-ng's, else pure Python)."""
    if len2 <= 0:  # zlib-ng loops forever on a negative length and gives crc1 ^ crc2 for 0
        return crc1 & 0xFFFFFFFF if len2 == 0 else refuse_negative(len2)
    if COMBINE is not None:
        return COMBINE(crc1 & 0xFFFFFFFF, crc2 & 0xFFFFFFFF, len2) & 0xFFFFFFFF
    return crc32_combine_py(crc1, crc2, len2)


def crc32_concat(parts: Iterable[tuple[int, int]], crc: int = 0) -> int:
    """CRC-32 of consecutive ranges given as ``(crc, length)`` in order, continuing from ``crc``."""
    for part_crc, length in parts:
        crc = crc32_combine(crc, part_crc, length)
    return crc


__all__ = ["COMBINE", "CRC32_IMPLEMENTATION", "POLY", "X2N", "crc32", "crc32_combine", "crc32_combine_py", "crc32_concat",
           "fast_crc32", "fast_crc32_combine", "multmodp", "x2nmodp"]
