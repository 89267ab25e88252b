"""Paths below a local checkpoint root, opened without following links.

The root is shared and untrusted: other jobs or people may plant symbolic links, hard links, FIFOs in
it. Everything the library deletes, creates or writes below a local root goes through these helpers,
which open each directory component with ``O_NOFOLLOW`` relative to its parent's descriptor, so that
nothing outside the root is ever deleted, truncated or written, whatever links the root holds. The
root itself is the caller's path: links in it are followed. Each helper costs a few system calls per
path component, never per byte.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Sequence

from checkpointd.errors import LinkedPathError

__all__ = ["create_file", "kind_of", "linked_error", "open_dir_below", "open_parent_below", "rel_parts",
           "remove_tree_at", "writable_here"]

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_DIR_FLAGS = os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC | _O_NONBLOCK


def rel_parts(rel: str) -> list[str]:
    """The components of a path relative to a root (``''`` and ``.`` dropped).

    Raises:
        LinkedPathError: a ``..`` component (it would leave the root).
    """
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise LinkedPathError(f"{rel!r} leads out of the checkpoint root ('..'); paths below the root never do")
    return parts


def kind_of(mode: int) -> str:
    """``regular file``, ``directory``, ``symbolic link``, ``fifo``, ``socket`` or ``device``."""
    if stat.S_ISREG(mode):
        return "regular file"
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISLNK(mode):
        return "symbolic link"
    if stat.S_ISFIFO(mode):
        return "fifo"
    if stat.S_ISSOCK(mode):
        return "socket"
    return "device"


def linked_error(where: str) -> LinkedPathError:
    return LinkedPathError(
        f"{where} is a symbolic link inside the checkpoint root; checkpointd never deletes, writes or reads "
        "through links below the root: remove the link (the link only, not what it points to)")


def open_dir_below(root: str, parts: Sequence[str], *, create: bool = False) -> int:
    """A descriptor of the directory ``root/parts...``, opened component by component with
    ``O_NOFOLLOW`` (the root itself is the caller's path: links in it are followed).

    ``create``: missing directories (the root included) are made. A few syscalls per component.

    Raises:
        FileNotFoundError: a component is missing (without ``create``).
        LinkedPathError: a component below the root is a symbolic link.
        NotADirectoryError: a component is a file (or a fifo, socket, device).
    """
    try:
        fd = os.open(root, os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC)
    except FileNotFoundError:
        if not create:
            raise
        os.makedirs(root, exist_ok=True)
        fd = os.open(root, os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC)
    try:
        for i, name in enumerate(parts):
            where = os.path.join(root, *parts[:i + 1])
            try:
                nxt = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o777, dir_fd=fd)
                nxt = _open_subdir(fd, name, where)
            except OSError as exc:
                raise _not_a_dir_error(fd, name, where, exc) from exc
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_subdir(fd: int, name: str, where: str) -> int:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=fd)
    except OSError as exc:
        raise _not_a_dir_error(fd, name, where, exc) from exc


def _not_a_dir_error(fd: int, name: str, where: str, exc: OSError) -> OSError:
    if exc.errno not in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
        return exc
    try:
        mode = os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode
    except OSError:
        return exc
    if stat.S_ISLNK(mode):
        return linked_error(where)
    return NotADirectoryError(errno.ENOTDIR, f"{where} is a {kind_of(mode)}, not a directory")


def open_parent_below(root: str, rel: str, *, create: bool = False) -> tuple[int, str]:
    """``(descriptor of the directory holding rel's last component, that component)``, as
    :func:`open_dir_below` opens directories."""
    parts = rel_parts(rel)
    if not parts:
        raise IsADirectoryError(errno.EISDIR, f"{root} is the checkpoint root, not a file below it")
    return open_dir_below(root, parts[:-1], create=create), parts[-1]


def create_file(dir_fd: int, name: str, where: str, flags: int = os.O_WRONLY) -> int:
    """A new, empty regular file ``name`` in ``dir_fd``: whatever name is there (a leftover, a link, a
    hard link to someone else's file) is unlinked first, never truncated or written through.

    Raises:
        IsADirectoryError: a directory is in the way.
        FileExistsError: the name keeps being made again by someone else.
    """
    for _ in range(3):
        try:
            os.unlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        except OSError as exc:
            if exc.errno in (errno.EISDIR, errno.EPERM):
                raise IsADirectoryError(errno.EISDIR, f"cannot write {where}: a directory is in the way; remove it") from exc
            raise
        try:
            return os.open(name, flags | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC, 0o644, dir_fd=dir_fd)
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, f"cannot write {where}: something else keeps creating that name")


def writable_here(fd: int) -> bool:
    """Whether the open file ``fd`` may be written over: a regular file with no other hard link (one
    ``fstat``). A file with more links is someone else's as well; it is never written into."""
    st = os.fstat(fd)
    return stat.S_ISREG(st.st_mode) and st.st_nlink <= 1


def remove_tree_at(dir_fd: int, name: str) -> None:
    """Delete ``name`` in ``dir_fd`` and everything under it, never following a link: a link (or any
    other non-directory) is unlinked itself; a missing name is not an error."""
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK, errno.ENXIO):
            raise
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=dir_fd)
        return
    try:
        with os.scandir(fd) as it:
            entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
        for child, is_dir in entries:
            if is_dir:
                remove_tree_at(fd, child)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(child, dir_fd=fd)
    finally:
        os.close(fd)
    with contextlib.suppress(FileNotFoundError):
        os.rmdir(name, dir_fd=dir_fd)
