"""Which filesystem a local path lives on (Linux ``/proc/self/mountinfo``), for choosing a write mode,
and whether (and how) a writer hands written ranges to the disk early (:func:`early_writeback`).

Why: the fastest way to fill one file from many threads depends on the filesystem. On a 16-core H200
host (3 GB into one file): on tmpfs, positional writes stop at one thread's speed (the inode lock,
~3 GB/s) while copying into a shared mapping of a pre-allocated file reaches ~5.2 GB/s with 8-16
threads; on ext4 both run at the disk's ~1.5 GB/s and the mapping loses a little through the whole
pipeline. So the ``auto`` write mode maps the file on memory-backed filesystems and uses ``pwrite``
elsewhere (:mod:`checkpointd.storage.writemode`).

Standard library only: the persist process loads this module by path, without the package.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
from typing import Any, Callable

MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs", "hugetlbfs"})


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal (``\\040``)."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


@functools.lru_cache(maxsize=1)
def _mounts() -> tuple[tuple[str, str], ...]:
    """``(mount point, fs type)`` pairs, longest mount point first; empty where unreadable."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return ()
    mounts = []
    for line in lines:
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if not sep or len(fields) < 5 or not right.split():
            continue
        mounts.append((_unescape(fields[4]), right.split()[0]))
    return tuple(sorted(mounts, key=lambda m: len(m[0]), reverse=True))


def filesystem_type(path: str) -> str | None:
    """The type (``"tmpfs"``, ``"ext4"``, ...) of the filesystem holding ``path``; None if unknown.

    The mount table is read once and read again when it does not match the path's device (a file
    system mounted or unmounted since: a job that mounts its checkpoint tmpfs after starting, a test's).
    A btrfs subvolume's device differs from its mount point's: there the table is read at every call
    (~0.1 ms; a few calls a save) and gives the same answer.
    """
    real = os.path.realpath(path)
    found = _mount_of(real)
    if found is not None and not _same_device(real, found[0]):
        _mounts.cache_clear()
        found = _mount_of(real)
    return found[1] if found is not None else None


def _mount_of(real: str) -> tuple[str, str] | None:
    for mount_point, fstype in _mounts():
        if real == mount_point or real.startswith(mount_point.rstrip("/") + "/"):
            return mount_point, fstype
    return None


def _same_device(path: str, mount_point: str) -> bool:
    """Whether ``path`` (or, not made yet, its nearest existing parent below ``mount_point``) is on the
    device mounted at ``mount_point``; True where that cannot be read."""
    while not os.path.lexists(path) and len(path) > len(mount_point):
        path = os.path.dirname(path)
    try:
        return os.stat(path).st_dev == os.stat(mount_point).st_dev
    except OSError:
        return True


def fd_filesystem_type(fd: int) -> str | None:
    """:func:`filesystem_type` of an open file descriptor (via ``/proc/self/fd``); None if unknown."""
    try:
        path = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
    if path.endswith(" (deleted)"):
        path = path[: -len(" (deleted)")]
    return filesystem_type(path)


def is_memory_backed(fstype: str | None) -> bool:
    return fstype in MEMORY_FILESYSTEMS


EARLY_WRITEBACK: bool | None = None
"""None (the default): early writeback for files on disk file systems (:func:`early_writeback`); True:
for every file, where the OS has it; False: never."""


def early_writeback(fd: int) -> bool:
    """Whether the writer of ``fd`` should start each written range's writeback at once.

    Why: a checkpoint file on a disk is made durable by one ``fsync`` at the end, and until then its
    pages only sit dirty in the page cache (a few GB stays below the kernel's background-writeback
    threshold), so the copy into the page cache and the disk's writing ran one after the other.
    ``sync_file_range(SYNC_FILE_RANGE_WRITE)`` on each range as soon as it is written starts the disk
    on it while the other ranges are still being copied; the final ``fsync`` then waits for the tail
    only. It also keeps the dirty memory of a save near the disk's queue instead of the whole file.
    Memory file systems have no writeback, so the automatic choice (:data:`EARLY_WRITEBACK` None) leaves
    them alone.
    """
    if EARLY_WRITEBACK is False or _sync_file_range() is None:
        return False
    if EARLY_WRITEBACK:
        return True
    fstype = fd_filesystem_type(fd)
    return fstype is not None and not is_memory_backed(fstype)


def start_writeback(fd: int, offset: int, nbytes: int) -> bool:
    """Start writing ``[offset, offset + nbytes)`` of ``fd`` to its disk without waiting for it.

    Returns False where the file system does not support it (the caller stops asking); I/O errors
    raise, as a write's would.
    """
    fn = _sync_file_range()
    if fn is None:
        return False
    if fn(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE) == 0:  # a ctypes call: the GIL is released meanwhile
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ESPIPE):
        return False
    raise OSError(err, f"sync_file_range: {os.strerror(err)}")


def writeback_starter(fd: int) -> Callable[[int, int], None]:
    """``written(offset, nbytes)`` for a writer of ``fd``: :func:`start_writeback` on each written range,
    no more calls once the file system said it does not support it."""
    supported = [True]

    def written(offset: int, nbytes: int) -> None:
        if supported[0] and nbytes:
            supported[0] = start_writeback(fd, offset, nbytes)
    return written


_SYNC_FILE_RANGE_WRITE = 2  # <fcntl.h>; Python's os module has no sync_file_range


@functools.lru_cache(maxsize=1)
def _sync_file_range() -> Any:
    """libc's ``sync_file_range`` through ctypes (Linux), or None."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def pwrite_all(fd: int, data: Any, offset: int) -> None:
    """Write all of ``data`` at ``offset`` (``os.pwrite`` may write less than asked).

    Here, in a standard-library module, because both the training process's writers
    (:mod:`checkpointd.storage.ptlayout`) and the persist process (which loads this module by path) use it."""
    view = memoryview(data)
    while view.nbytes:
        done = os.pwrite(fd, view, offset)
        if done <= 0:
            raise OSError(f"pwrite wrote {done} bytes")
        view, offset = view[done:], offset + done


__all__ = ["EARLY_WRITEBACK", "early_writeback", "fd_filesystem_type", "filesystem_type", "is_memory_backed",
           "pwrite_all", "start_writeback", "writeback_starter"]
