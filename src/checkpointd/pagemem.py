"""Populating page tables ahead (``madvise(MADV_POPULATE_*)``, Linux 5.14+), off the paths that wait.

Why: touching gigabytes of fresh memory one page fault at a time is slow, and where the faults happen
matters. A restore maps a tmpfs file and checksums it: populating each range first maps its pages in
one call instead of a fault per page (:mod:`checkpointd.fastload`). A staging arena is page-locked with
``cudaHostRegister``; given fresh pages, the driver allocates and zeroes every one of them inside that
call, ~0.4 s per GiB during which the training thread's own CUDA calls waited (H200 host, 4.83 GB: one
step of 1.7-2.8 s early in every run, ``benchmarks/RESULTS.md`` session 17). Populated first on the
preparing thread, the pages exist and the registration only pins them.

Both calls go through ctypes, which releases the GIL; where ``madvise`` or the advice is missing they do
nothing (the pages are then faulted in as before).
"""

from __future__ import annotations

import ctypes
from typing import Any

MADV_POPULATE_READ = 22
MADV_POPULATE_WRITE = 23
POPULATE_CHUNK_BYTES = 64 << 20
""":func:`populate_write` advises this much at a time (each call holds the memory map's lock)."""

_MADVISE: list[Any] = []


def _libc_madvise() -> Any:
    if not _MADVISE:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fn = libc.madvise
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            fn.restype = ctypes.c_int
            _MADVISE.append(fn)
        except (OSError, AttributeError):
            _MADVISE.append(None)
    return _MADVISE[0]


def populate_read(addr: int, length: int) -> None:
    """Best effort: map ``[addr, addr + length)`` readable (a file's existing pages) in one call."""
    fn = _libc_madvise()
    if fn is not None:
        fn(ctypes.c_void_p(addr), ctypes.c_size_t(length), MADV_POPULATE_READ)


def populate_write(addr: int, length: int, threads: int = 1) -> bool:
    """Best effort: allocate and map every page of ``[addr, addr + length)`` writable, in chunks.

    ``addr`` is rounded down to its page (madvise needs an aligned start). ``threads`` > 1 populates
    chunks on that many threads at once (each call holds the memory map's lock for reading only, so
    they run side by side). False where the kernel refused (older than 5.14, or not a mapping it
    populates): the pages come by faults instead.
    """
    fn = _libc_madvise()
    if fn is None or length <= 0:
        return False
    page = 4096
    start = addr - addr % page
    end = addr + length
    chunks = [(a, min(POPULATE_CHUNK_BYTES, end - a)) for a in range(start, end, POPULATE_CHUNK_BYTES)]

    def one(chunk: tuple[int, int]) -> bool:
        return fn(ctypes.c_void_p(chunk[0]), ctypes.c_size_t(chunk[1]), MADV_POPULATE_WRITE) == 0

    if threads <= 1 or len(chunks) == 1:
        return all(one(c) for c in chunks)  # stops at the first refusal
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(threads, len(chunks)), thread_name_prefix="checkpointd-populate") as pool:
        return all(list(pool.map(one, chunks)))


__all__ = ["MADV_POPULATE_READ", "MADV_POPULATE_WRITE", "populate_read", "populate_write"]
