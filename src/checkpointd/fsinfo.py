"""Which filesystem a local path lives on (Linux ``/proc/self/mountinfo``), for choosing a write mode.

Why: the fastest way to fill one file from many threads depends on the filesystem. Measured on a
16-core H200 host (``benchmarks/RESULTS.md``, 3 GB into one file): on tmpfs, positional writes stop at
one thread's speed (the inode lock, ~3 GB/s) while copying into a shared mapping of a pre-allocated
file reaches ~5.2 GB/s with 8-16 threads; on ext4 both run at the disk's ~1.5 GB/s and the mapping
loses a little through the whole pipeline. So ``CHECKPOINTD_WRITE_MODE=auto`` maps the file on
memory-backed filesystems and uses ``pwrite`` elsewhere (not the default: see ``ptlayout.write_mode``).
"""

from __future__ import annotations

import functools
import os

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
    """The type (``"tmpfs"``, ``"ext4"``, ...) of the filesystem holding ``path``; None if unknown."""
    real = os.path.realpath(path)
    for mount_point, fstype in _mounts():
        if real == mount_point or real.startswith(mount_point.rstrip("/") + "/"):
            return fstype
    return None


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


__all__ = ["fd_filesystem_type", "filesystem_type", "is_memory_backed"]
