"""How the bytes of a local checkpoint file go in: positional writes or a shared mapping, and how many
threads write one file at once.

Two ways to put the bytes in a file: ``pwrite`` and ``mmap``; ``auto`` maps files on memory file
systems (tmpfs) and uses ``pwrite`` elsewhere. Linux serialises buffered writes into one file (the
inode lock), so ``pwrite`` from many threads runs at one thread's speed per file (~3 GB/s on tmpfs);
copying into a shared mapping of the pre-sized file scales with threads (on a 16-core host, 3 GB into
one file: tmpfs ``pwrite`` 2.6-3.1 GB/s at any thread count, ``mmap`` 5.2 GB/s at 8-16 threads; ext4
~1.5 GB/s either way). ``mmap`` reserves the space with ``posix_fallocate`` first, so a full disk
fails with ENOSPC rather than SIGBUS.

Which way, by default (:data:`WRITE_MODE` None): the persist process maps files on memory file systems
(``auto``: its page faults are not the training's), while threads of the training process write by
``pwrite`` (:func:`write_mode` says why), except for a save nobody trains beside (a preemption save,
``fast``), which maps files on memory file systems too.
"""

from __future__ import annotations

from checkpointd.storage import fsinfo
from checkpointd.storage.iopool import io_threads

WRITE_MODE: str | None = None
"""``pwrite``, ``mmap`` or ``auto`` for every local file, in this process and in the persist process;
None (the default): the automatic choice of :func:`write_mode` and :func:`persist_mode`."""

WRITE_LANES = 4
"""Threads that write one file at once by ``pwrite`` (:func:`write_lanes`)."""

FAST_PERSIST = False
"""True: every save is written as a preemption save is (:func:`fast_persist`); False (the default):
only saves that a preemption signal triggers, which the job's grace period waits for.

It concerns in-process writes only: records that the persist process writes (the default for staged
tensors, :mod:`checkpointd.storage.persist_process`) are always written at full speed there. A gentle
write puts :func:`write_lanes` threads by ``pwrite`` on each file, which the training steps barely
feel; a fast one maps files on memory file systems and puts every I/O thread on each mapped file
(positional writes elsewhere keep :func:`write_lanes`: one file's writes serialise anyway). On an H200
host (16 cores, tmpfs, 4.8 GB) gentle writes persist at 4.1-4.7 GB/s and cost the training steps that
run meanwhile ~1 ms; fast ones persist at 6.7 GB/s and cost them ~190 ms per checkpoint (page faults on
the mappings contend with the training process)."""


def fast_persist() -> bool:
    """Whether every save is written fast (:data:`FAST_PERSIST`), not only preemption saves."""
    return FAST_PERSIST


def write_lanes() -> int:
    """Threads that write one file at once (:data:`WRITE_LANES`, 4).

    More do not write faster: buffered writes to one file serialise on the file's inode lock (tmpfs,
    ext4, xfs). On an H200 host (16 cores, tmpfs, 5 GB from pinned memory) 4 threads write one file at
    3.0-3.1 GB/s, 16 threads at 1.7-2.8 GB/s, and the 16 cost the training steps that run meanwhile
    10-16 ms against 0-5 ms. Files of one save are written side by side, each with its own lanes.
    """
    return max(1, WRITE_LANES)


def resolve_mode(mode: str, fd: int | None) -> str:
    """``pwrite`` or ``mmap`` for ``mode`` (``pwrite``, ``mmap`` or ``auto``; anything else is ``pwrite``)
    and the file ``fd``: ``auto`` is ``mmap`` on memory-backed file systems."""
    if mode != "auto":
        return mode if mode in ("pwrite", "mmap") else "pwrite"
    if fd is None:
        return "pwrite"
    return "mmap" if fsinfo.is_memory_backed(fsinfo.fd_filesystem_type(fd)) else "pwrite"


def write_mode(fd: int | None = None) -> str:
    """``pwrite`` or ``mmap`` for this process's writes into the file ``fd``: :data:`WRITE_MODE`, by
    default ``pwrite``.

    ``pwrite`` is the default although ``mmap`` persists ~2x faster on tmpfs: on an H200 host, 16
    threads faulting pages of a mapping slow the *training* steps that run meanwhile by ~220 ms per
    checkpoint (page faults and the training process's own memory mappings share one lock), against
    ~25 ms for ``pwrite``. ``mmap``/``auto`` suit runs where persist time matters more than the training
    stall (a process that only writes).
    """
    return resolve_mode((WRITE_MODE or "pwrite").strip().lower(), fd)


def persist_mode(fd: int, mode: str | None = None) -> tuple[str, int]:
    """``(mode, lanes)`` the persist process writes ``fd`` with: ``mode``, else :data:`WRITE_MODE`, by
    default ``auto`` (a mapping on memory file systems, filled by every I/O thread; else
    :func:`write_lanes` positional writers)."""
    chosen = resolve_mode((mode if mode is not None else (WRITE_MODE or "auto")).strip().lower(), fd)
    return chosen, io_threads() if chosen == "mmap" else write_lanes()


__all__ = ["FAST_PERSIST", "WRITE_LANES", "WRITE_MODE", "fast_persist", "persist_mode", "resolve_mode", "write_lanes",
           "write_mode"]
