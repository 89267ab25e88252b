"""The recycling bin: a directory under the checkpoint root holding retired (and blank) large files
that later saves write over instead of allocating new ones (:mod:`checkpointd.storage.recycle` says why).

Retired files are moved into ``<root>/.checkpointd-recycle/`` under a name ending in
:data:`CHECKING_SUFFIX` while they are checked for other users, then under one ending in
:data:`READY_SUFFIX`, which savers take (:func:`take_open`).

What keeps this safe:
- A file is recycled only if nothing else has it open or mapped (an evaluation job still reading a
  retired checkpoint keeps reading intact bytes, as it would after a deletion): checked with a write
  lease (``F_SETLEASE``), which the kernel grants only when no other open file refers to the file
  (:func:`exclusive`). The check runs after the file left its step directory (no new opener can find
  it) and ahead of the name that savers take. The persist process keeps its mapping of each file it
  wrote (:class:`checkpointd.storage.persist_mappings.KeptFile`), so it takes that lease on its own
  descriptor (:func:`ask_mapping_holder`); only for files it keeps no mapping of is the lease taken here.
  Where leases are not available (not Linux, a network file system), retired files are deleted.
- Files with other hard links are deleted, never recycled; and a file a save takes is checked on its
  open descriptor right before it is written (a regular file with one link, :func:`take_open`), so a
  hard link or a link planted in the bin is never written through.
- Nothing the bin deletes, renames or writes over lies outside the root, whatever links the root holds:
  the bin and the step directories are opened without following links and every file is moved by
  descriptor. A bin that is a symbolic link (or not a directory) is never used: recycling is skipped
  for that root, with one warning; :func:`empty` (``close()``, ``checkpointd gc``) removes the link
  itself, never its target.

:func:`checkpointd.options.recycle_enabled` turns recycling off (files are deleted, new ones created).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
from collections.abc import Callable
from typing import Any

from checkpointd import options
from checkpointd.storage import localpaths

try:
    import fcntl
except ImportError:  # not POSIX: no leases, no recycling
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger("checkpointd")

BIN_NAME = ".checkpointd-recycle"
"""The bin's directory name under the checkpoint root (not step-shaped: listings ignore it)."""
MIN_RECYCLE_BYTES = 16 << 20
"""Smaller files are deleted: recycling them saves nothing worth a rename."""
TAKE_RATIO = 1.5
"""A file in the bin is taken for ``nbytes`` only if it is at most this many times as large."""

READY_SUFFIX = ".bin"
"""Bin entries that a save may take; :data:`CHECKING_SUFFIX` ones are still being checked for other users."""
CHECKING_SUFFIX = ".checking"
"""Bin entries that are not taken yet: retired files being checked, blank files being made."""

F_SETLEASE: int | None = getattr(fcntl, "F_SETLEASE", None)
"""The lease command (Linux only); None: no leases, no recycling."""
O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_BIN_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | O_NOFOLLOW | O_CLOEXEC | os.O_NONBLOCK

_mapping_holders: list[Callable[[os.stat_result], bool | None]] = []


def enabled(store: Any) -> bool:
    """Recycling applies to local stores on Linux, unless :func:`checkpointd.options.recycle_enabled` says off."""
    return F_SETLEASE is not None and getattr(store, "is_local", False) and options.recycle_enabled()


def bin_dir(store: Any) -> str:
    """The bin's path under ``store``'s root."""
    return os.path.join(store.path(""), BIN_NAME)


def bin_for(store: Any) -> str | None:
    """The bin a save on ``store`` may take retired files from; None where recycling does not apply."""
    return bin_dir(store) if enabled(store) else None


def ask_mapping_holder(holds_only_open: Callable[[os.stat_result], bool | None]) -> None:
    """Have :func:`exclusive` ask ``holds_only_open(st)`` first whether the file ``st`` describes is used
    by nobody else: True or False where the asked one keeps the file mapped, None where it does not.

    The persist process's client (:mod:`checkpointd.storage.persist_process`) registers itself here when
    it is imported: the process keeps its mapping of each file it wrote, and only it can take the
    lease on its own descriptor. This module is below it and never imports it."""
    if holds_only_open not in _mapping_holders:
        _mapping_holders.append(holds_only_open)


def exclusive(bin_fd: int, name: str) -> bool:
    """True if ``name`` in the bin is a regular file with one link and no open file other than ours
    refers to it (a write lease is granted only then).

    The holders of kept mappings (:func:`ask_mapping_holder`: the persist process) are asked first:
    they take the lease on their own descriptor. Only where none keeps the file is the lease taken here.
    """
    if F_SETLEASE is None:
        return False
    try:
        st = os.stat(name, dir_fd=bin_fd, follow_symlinks=False)
    except OSError:
        return False
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        return False
    for holds_only_open in list(_mapping_holders):
        held = holds_only_open(st)
        if held is not None:
            return held
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC, dir_fd=bin_fd)
    except OSError:
        return False
    try:
        mine = os.fstat(fd)
        if (mine.st_dev, mine.st_ino) != (st.st_dev, st.st_ino) or mine.st_nlink != 1:
            return False  # replaced meanwhile
        fcntl.fcntl(fd, F_SETLEASE, fcntl.F_WRLCK)
    except OSError:
        return False  # EAGAIN: opened or mapped elsewhere; EINVAL: no leases on this file system
    else:
        try:
            fcntl.fcntl(fd, F_SETLEASE, fcntl.F_UNLCK)
        except OSError:
            pass
        return True
    finally:
        os.close(fd)


_warned_lock = threading.Lock()
_warned: set[str] = set()


def open_bin(directory: str, create: bool = False) -> int | None:
    """A descriptor of the bin, opened without following a link; None where there is none (or, with
    ``create``, it cannot be made) or it is unusable: a bin that is a symbolic link or not a directory
    is never used (recycling is skipped for that root, with one warning naming it)."""
    try:
        return os.open(directory, _BIN_FLAGS)
    except FileNotFoundError:
        if not create:
            return None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK, errno.ENXIO):
            _warn_unusable(directory)
        return None
    try:
        os.makedirs(os.path.dirname(directory), exist_ok=True)  # the root: the caller's path
        os.mkdir(directory, 0o777)
    except FileExistsError:
        pass
    except OSError:
        return None
    try:
        return os.open(directory, _BIN_FLAGS)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK, errno.ENXIO):
            _warn_unusable(directory)
        return None


def _warn_unusable(directory: str) -> None:
    with _warned_lock:
        if directory in _warned:
            return
        _warned.add(directory)
    logger.warning(
        "checkpointd: %s is a symbolic link or not a directory; retired files are not recycled under this "
        "root (they are deleted). Remove it: `checkpointd gc` or closing a manager removes it (a link "
        "as a link, never what it points to)", directory)


def scan(dir_fd: int, min_bytes: int = 0) -> list[tuple[str, int]]:
    """``(name, size)`` of the regular files of at least ``min_bytes`` directly in ``dir_fd`` with no
    other hard link (links, fifos, hard-linked files skipped)."""
    out = []
    with os.scandir(dir_fd) as it:
        for entry in it:
            try:
                if entry.is_file(follow_symlinks=False):
                    st = entry.stat(follow_symlinks=False)
                    if st.st_size >= min_bytes and st.st_nlink == 1:
                        out.append((entry.name, st.st_size))
            except OSError:
                continue
    return out


def bin_entries(directory: str) -> list[tuple[str, int]]:
    """``(path, size)`` of the files in the bin that a save could take ([] for an unusable bin)."""
    fd = open_bin(directory)
    if fd is None:
        return []
    try:
        return [(os.path.join(directory, name), size) for name, size in scan(fd)]
    finally:
        os.close(fd)


def large_files_at(dir_fd: int, name: str) -> list[tuple[int, str, int]]:
    """``(directory descriptor, name, size)`` of the large regular files under ``name`` in ``dir_fd``,
    descended without following links (``os.fwalk``); the descriptors are duplicates that the caller
    closes (see :meth:`checkpointd.storage.recycle.Retirement.retire`)."""
    out = []
    for _dirpath, _dirs, _files, fd in os.fwalk(name, dir_fd=dir_fd, follow_symlinks=False):
        found = scan(fd, MIN_RECYCLE_BYTES)
        if found:
            kept = os.dup(fd)
            out.extend((kept, n, size) for n, size in found)
    return out


def unlink_at(dir_fd: int, name: str) -> None:
    """Unlink ``name`` in the directory ``dir_fd``; a missing name is not an error."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass


def empty(store: Any) -> None:
    """Delete the bin and every file in it (``close()``: no save of this run will take them).

    A bin that is a symbolic link (or not a directory) is removed itself, as a link: never what it
    points to. Links, fifos and hard links in the bin are removed as names, never followed.
    """
    directory = bin_dir(store)
    fd = open_bin(directory)
    if fd is None:
        try:
            if not stat.S_ISDIR(os.lstat(directory).st_mode):
                os.unlink(directory)  # a link or a file planted at the bin's name: the name goes, not its target
        except (FileNotFoundError, NotADirectoryError):
            pass
        return
    clear_bin(fd)
    try:
        os.rmdir(directory)
    except OSError:
        pass  # absent, or a retirement beside us just put a file in


def clear_bin(fd: int) -> None:
    """Unlink every non-directory entry of the open bin ``fd`` (names only, never a link's target), then close it."""
    try:
        with os.scandir(fd) as it:
            names = [e.name for e in it if not e.is_dir(follow_symlinks=False)]
        for name in names:
            unlink_at(fd, name)
    finally:
        os.close(fd)


def contents(store: Any) -> tuple[int, int]:
    """``(files, bytes)`` in the bin (``checkpointd gc`` reports them before emptying it)."""
    entries = bin_entries(bin_dir(store))
    return len(entries), sum(n for _, n in entries)


def take(directory: str, path: str, nbytes: int) -> bool:
    """Rename a retired file from the bin ``directory`` to ``path`` (see :func:`take_open`); False if the
    bin has none that fits (or others took them first)."""
    try:
        dir_fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | O_CLOEXEC)
    except OSError:
        return False
    try:
        fd = take_open(directory, dir_fd, os.path.basename(path), nbytes)
    finally:
        os.close(dir_fd)
    if fd is None:
        return False
    os.close(fd)
    return True


def take_open(directory: str, dir_fd: int, name: str, nbytes: int) -> int | None:
    """Rename a retired file from the bin ``directory`` to ``name`` in the directory ``dir_fd`` (the
    smallest of at least ``nbytes``, else the largest; none over :data:`TAKE_RATIO` times ``nbytes``)
    and return it open for reading and writing; None if the bin has none (or others took them first).

    The file is checked on the open descriptor, right before the caller writes: a regular file with
    no other hard link. One that is not (a link or a hard link planted in the bin) leaves its new
    name at once and the next is tried. A bin that is a link or not a directory is not used.

    Why no much larger file: a save takes its files one after the other, and with only some of the
    blank files made ahead in the bin, the model's file would take the optimizer's (twice its size; cut
    to size, the pages made for it are thrown away) and the optimizer's then find none. Retired and
    blank files are within 1 % of the size they are taken for. Smaller ones are taken (and grown):
    a compressed file's ``nbytes`` is its raw size.
    """
    if nbytes < MIN_RECYCLE_BYTES:
        return None
    bin_fd = open_bin(directory)
    if bin_fd is None:
        return None
    try:
        entries = [e for e in scan(bin_fd) if e[0].endswith(READY_SUFFIX) and e[1] <= nbytes * TAKE_RATIO]
        fits = sorted((e for e in entries if e[1] >= nbytes), key=lambda e: e[1])
        rest = sorted((e for e in entries if e[1] < nbytes), key=lambda e: -e[1])
        for candidate, _ in fits + rest:
            try:
                os.rename(candidate, name, src_dir_fd=bin_fd, dst_dir_fd=dir_fd)
            except FileNotFoundError:
                continue  # another writer (rank) took it first
            except OSError as exc:
                if exc.errno in (errno.EXDEV, errno.EISDIR, errno.ENOTDIR):
                    return None
                continue
            try:
                fd = os.open(name, os.O_RDWR | os.O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC, dir_fd=dir_fd)
            except OSError:
                unlink_at(dir_fd, name)  # replaced by a link (or worse) meanwhile: never written through
                continue
            if localpaths.writable_here(fd):
                os.set_blocking(fd, True)
                return fd
            os.close(fd)
            unlink_at(dir_fd, name)  # another link to it exists: someone else's file, never written into
        return None
    finally:
        os.close(bin_fd)


__all__ = ["BIN_NAME", "CHECKING_SUFFIX", "F_SETLEASE", "MIN_RECYCLE_BYTES", "READY_SUFFIX", "TAKE_RATIO", "ask_mapping_holder",
           "bin_dir", "bin_entries", "bin_for", "clear_bin", "contents", "empty", "enabled", "exclusive", "large_files_at",
           "open_bin", "scan", "take", "take_open", "unlink_at"]
