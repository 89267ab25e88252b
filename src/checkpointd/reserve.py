"""Reserving a save's new files while its snapshot is still being taken (store stage, ahead of the writes).

Why: on a memory file system every page of a new file is allocated and zeroed by ``posix_fallocate``
before the persist process maps the file and copies the staged bytes in (reserved first, so that a
full file system is ENOSPC and never SIGBUS in a copy). For the reference state (4.83 GB in a model and
an optimizer file, H200 host, tmpfs) that reservation took 0.34-0.53 s of a save's writing, the copies
0.24-0.26 s (``benchmarks/RESULTS.md``, session 32). The reservation needs only a file's size, known once
the save is planned, not its bytes: so the committer thread reserves the files right after planning,
while the snapshot's copies are still running (CUDA: the device-to-host copies; CPU state: the copies
``maybe_save`` makes after handing the job over, see :attr:`checkpointd.writer.SaveJob.copy_cpu`). The
persist process's own reservation at write time then finds every page in place.

Where it applies (:func:`applies`): single-process saves to a local memory file system that the
persist process writes through a mapping, without a codec. Not elsewhere: on disks the writes go by
``pwrite`` and reserve nothing; a distributed save's ranks create their files only after rank 0 has
cleared the step directory (the commit protocol's order). A file that a save takes from the recycling
bin (:mod:`checkpointd.recycle`) is taken here instead of at write time: its pages exist already.

What it costs: one thread (of a pool of :data:`RESERVE_THREADS`) per file in ``posix_fallocate``, kernel
time that the write would have spent anyway, a little earlier. A reserved file that is never written
(the save failed before writing) is removed (:meth:`ReservedFile.discard`).
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from . import recycle

logger = logging.getLogger("checkpointd")

RESERVE_ENV = "CHECKPOINTD_RESERVE_AHEAD"
"""``0`` turns the reservation ahead off (files are reserved when they are written, as before)."""
RESERVE_THREADS = 2
"""Files reserved at once (a save has a model and an optimizer file, plus small ones that need none);
the CPU copies beside them leave as many cores free (``savejob._CpuCopies``)."""
MIN_RESERVE_BYTES = 16 << 20
"""Smaller files are created when written: reserving them ahead saves nothing worth a thread."""

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def enabled() -> bool:
    return os.environ.get(RESERVE_ENV, "1").strip() != "0"


def applies(store: Any, codec: Any) -> bool:
    """Whether saves to ``store`` with ``codec`` reserve their new files ahead (see the module docstring).

    Decided from the root directory's file system and the persist process's availability, once per
    manager: a memory file system and a persist process that writes through mappings.
    """
    if not enabled() or not getattr(store, "is_local", False) or getattr(codec, "name", None) != "none":
        return False
    from . import ptlayout, sharedmem
    from .writer import PARALLEL_WRITE_ENV

    if os.environ.get(PARALLEL_WRITE_ENV, "1") == "0" or not sharedmem.supported():
        return False
    directory = os.path.abspath(store.path(""))
    while not os.path.isdir(directory) and os.path.dirname(directory) != directory:
        directory = os.path.dirname(directory)  # the root is made by the first write: its parent's file system
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return False
    try:
        return ptlayout.persist_mode(fd)[0] == "mmap"
    finally:
        os.close(fd)


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=RESERVE_THREADS, thread_name_prefix="checkpointd-reserve")
        return _pool


class ReservedFile:
    """A save's file, created (or taken from the recycling bin) and being reserved up to its size.

    The writer owns it from here: :func:`checkpointd.ptlayout.write_file` writes into :attr:`fd` (after
    :meth:`wait`) and closes it; a save that fails before writing calls :meth:`discard`.
    """

    def __init__(self, path: str, fd: int, nbytes: int, recycled: bool, reserving: Future | None) -> None:
        self.path = path
        self.fd = fd
        self.nbytes = nbytes
        self.recycled = recycled
        """Taken from the recycling bin (its pages exist; nothing to reserve)."""
        self._reserving = reserving

    def wait(self) -> None:
        """Block until the reservation ended; raises its ``OSError`` (ENOSPC: the file system is full)."""
        if self._reserving is not None:
            self._reserving.result()

    def discard(self) -> None:
        """Close and remove the file (a save that ends before writing it): its pages are freed now."""
        try:
            if self._reserving is not None:
                self._reserving.exception()  # the reservation must end before the file goes
        finally:
            try:
                os.close(self.fd)
            except OSError:
                pass
            try:
                os.unlink(self.path)
            except OSError:
                pass


def reserve_file(path: str, nbytes: int, recycle_from: str | None) -> ReservedFile | None:
    """Create ``path`` (or take a retired file for it from ``recycle_from``) and start reserving
    ``nbytes`` bytes on a pool thread; None for files too small to bother (created when written)."""
    if nbytes < MIN_RESERVE_BYTES:
        return None
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)  # RDWR: the write maps it
    recycled = recycle_from is not None and recycle.take(recycle_from, path, nbytes)
    fd = os.open(path, flags if recycled else flags | os.O_TRUNC, 0o644)
    if recycled:
        return ReservedFile(path, fd, nbytes, True, None)
    try:
        reserving = _executor().submit(os.posix_fallocate, fd, 0, nbytes)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    return ReservedFile(path, fd, nbytes, False, reserving)


__all__ = ["RESERVE_ENV", "ReservedFile", "applies", "enabled", "reserve_file"]
