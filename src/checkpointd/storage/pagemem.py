"""Populating page tables ahead (``madvise(MADV_POPULATE_*)``, Linux 5.14+), off the paths that wait.

Why: touching gigabytes of fresh memory one page fault at a time is slow, and where the faults happen
matters. A restore maps a tmpfs file and checksums it: populating each range first maps its pages in
one call instead of a fault per page (:mod:`checkpointd.restore.fastload`). A staging arena is page-locked with
``cudaHostRegister``; given fresh pages, the driver allocates and zeroes every one of them inside that
call, ~0.4 s per GiB during which the training thread's own CUDA calls wait (H200 host, 4.83 GB: one
step of 1.7-2.8 s early in every run). Populated first on the preparing thread, the pages exist and the
registration only pins them.

Both calls go through ctypes, which releases the GIL; where ``madvise`` or the advice is missing they do
nothing (the pages are then faulted in one by one on first touch).

The other way round, :class:`PiecewiseReleasedMap` lets a large mapping go without holding up the rest
of the process (see there).
"""

from __future__ import annotations

import ctypes
import mmap
from typing import Any

MADV_DONTNEED = 4
MADV_POPULATE_READ = 22
MADV_POPULATE_WRITE = 23
POPULATE_CHUNK_BYTES = 64 << 20
""":func:`populate_write` advises this much at a time (each call holds the memory map's lock)."""
RELEASE_PIECE_BYTES = 64 << 20
""":class:`PiecewiseReleasedMap` drops this much at a time."""

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


def _pieces(start: int, end: int, piece: int) -> list[tuple[int, int]]:
    """``(address, length)`` of each piece of at most ``piece`` bytes covering ``[start, end)``."""
    return [(a, min(piece, end - a)) for a in range(start, end, piece)]


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
    chunks = _pieces(start, end, POPULATE_CHUNK_BYTES)

    def one(chunk: tuple[int, int]) -> bool:
        return fn(ctypes.c_void_p(chunk[0]), ctypes.c_size_t(chunk[1]), MADV_POPULATE_WRITE) == 0

    if threads <= 1 or len(chunks) == 1:
        return all(one(c) for c in chunks)  # stops at the first refusal
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(threads, len(chunks)), thread_name_prefix="checkpointd-populate") as pool:
        return all(list(pool.map(one, chunks)))


def release_in_pieces(addr: int, length: int, piece: int | None = None) -> int:
    """``madvise(MADV_DONTNEED)`` over ``[addr, addr + length)``, ``piece`` bytes a call (default
    :data:`RELEASE_PIECE_BYTES`); the calls made.

    Only for memory nothing will read again (its private pages are discarded). Best effort: nothing
    where ``madvise`` is missing.
    """
    fn = _libc_madvise()
    if fn is None or length <= 0 or addr <= 0:
        return 0
    pieces = _pieces(addr, addr + length, piece or RELEASE_PIECE_BYTES)
    for a, n in pieces:
        fn(ctypes.c_void_p(a), ctypes.c_size_t(n), MADV_DONTNEED)
    return len(pieces)


class PiecewiseReleasedMap(mmap.mmap):
    """A writable ``mmap.mmap`` whose pages are dropped in pieces just before it is unmapped.

    Why: unmapping a large populated mapping tears its page tables down under the process's memory-map
    lock held for writing, the whole time; any other thread that maps memory meanwhile (starting a
    thread, a large ``malloc``, a CUDA host allocation) or faults a page waits for all of it. Unmapped at
    once, a restore's 4.8 GB read buffer, freed off the training thread after the restore
    (``restore.drop_later``), holds a thread start of the next step for 22-87 ms in three of six restores
    on an H200 host; on a 2-core VM a 3 GiB mapping holds a thread start 100-240 ms.
    ``MADV_DONTNEED`` does the same teardown holding that lock for reading, one piece at a time (other
    threads wait at most one piece: ~4 ms on that VM), and the final ``munmap`` then finds no pages.
    Done in ``__del__``, when nothing can reach the mapping any more. Used for restore buffers
    (:mod:`checkpointd.restore.fastload`) and staging arenas (one replaced when optimizer state appears).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # mmap.__new__ has mapped it already
        try:
            anchor = ctypes.c_char.from_buffer(self)
            self._release_addr = ctypes.addressof(anchor)
            del anchor  # (a buffer export: the mapping could not be closed while it lived)
        except (TypeError, ValueError):  # read-only or empty: unmapped the usual way
            self._release_addr = 0
        self._release_len = len(self)

    def __del__(self) -> None:
        try:
            if not self.closed:
                release_in_pieces(self._release_addr, self._release_len)
        except Exception:  # noqa: BLE001 - interpreter shutdown: the plain unmap still happens
            pass


__all__ = ["MADV_DONTNEED", "MADV_POPULATE_READ", "MADV_POPULATE_WRITE", "PiecewiseReleasedMap", "populate_read",
           "populate_write", "release_in_pieces"]
