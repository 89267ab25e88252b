"""What the persist process holds: the staging slabs it maps, the file mappings it keeps between writes,
the files attached to it, and the check every file passes before a byte goes in.

Standard library only: the persist process (:mod:`checkpointd.storage.persist_process_main`) loads this
module by path, without the package.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import stat
from typing import Any, Callable

try:
    import fcntl
except ImportError:  # not POSIX: the process never runs there (it needs memfd), but this module is imported
    fcntl = None  # type: ignore[assignment]


class Slab:
    """A staging slab lent by the training process: its shared memory mapped here, and its address."""

    def __init__(self, fd: int, nbytes: int) -> None:
        self.mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.view = memoryview(self.mapping)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.mapping))
        self.nbytes = nbytes


class KeptFile:
    """One file's shared mapping, kept after its write for the next write into the same file.

    Why: a save on a memory file system fills its files through a mapping, and a new mapping of a
    4.8 GB file takes 1.2 million page faults to fill, then a burst of TLB shootdowns when it is
    unmapped, even when the file's pages exist (recycling: the save writes over a retired file, the
    same inode). Kept, the next save into that file finds every page mapped: on an H200 host the writing
    takes 0.16-0.19 s with a kept mapping against 0.37-0.45 s with a new one, with no faults or shootdowns.

    What it costs: page tables (2 MiB per GiB mapped) and a descriptor; the file's pages are the file's
    own. A deleted file's pages are freed only when its mapping goes, so the server
    (:meth:`checkpointd.storage.persist_process_main.Server.prune`) lets go of unlinked files every
    ``PRUNE_INTERVAL_S``. The kept descriptor makes the file look open to
    others: retention's check that nothing else uses a retired file asks this process
    (``exclusive``), which takes the lease on the kept descriptor itself.
    """

    def __init__(self, fd: int, nbytes: int) -> None:
        self.fd = os.dup(fd)
        try:
            self.mapping = mmap.mmap(self.fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        self.anchor: Any = ctypes.c_char.from_buffer(self.mapping)
        self.base = ctypes.addressof(self.anchor)
        self.nbytes = nbytes

    def unlinked(self) -> bool:
        """The file has no name left (or cannot be checked): its mapping must not be used or kept."""
        try:
            return os.fstat(self.fd).st_nlink == 0
        except OSError:
            return True

    def exclusive(self) -> bool:
        """No open file of this file but ours (a write lease is granted only then)."""
        if fcntl is None or not hasattr(fcntl, "F_SETLEASE"):
            return False
        try:
            fcntl.fcntl(self.fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
        except OSError:
            return False
        try:
            fcntl.fcntl(self.fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        except OSError:
            pass
        return True

    def close(self) -> None:
        """Unmap the file and close the kept descriptor."""
        self.anchor = None
        self.mapping.close()
        os.close(self.fd)


def check_writable(fd: int) -> None:
    """Refuse to write into ``fd`` unless it is a regular file with no other hard link (one ``fstat``
    a request): a file with another link is someone else's as well, and is never written into.

    The requester opens every file it sends without following links (``O_NOFOLLOW``) and checks it the
    same way; this is the same rule where the bytes are written.

    Raises:
        OSError: EPERM, naming what the file is.
    """
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise OSError(errno.EPERM, "refusing to write into something that is not a regular file "
                      f"(mode {oct(st.st_mode)})")
    if st.st_nlink > 1:
        raise OSError(errno.EPERM, f"refusing to write into a file with {st.st_nlink} hard links (another "
                      "link is someone else's)")


def same_file(fd: int, st: os.stat_result) -> bool:
    """``fd`` is open on the live file ``st`` describes: same device and inode number (which a deleted
    file, or a 32-bit tmpfs inode counter that wrapped, could share), linked, and the same change time
    and size (one inode read twice in a row)."""
    try:
        mine = os.fstat(fd)
    except OSError:
        return False
    return (mine.st_nlink > 0 and (mine.st_dev, mine.st_ino, mine.st_ctime_ns, mine.st_size)
            == (st.st_dev, st.st_ino, st.st_ctime_ns, st.st_size))


class AttachedFile:
    """A file held between ``attach`` and ``detach``: our descriptor, how bytes are put into it, and the
    kept mapping it was checked out with (if any)."""

    def __init__(self, fd: int, put: Callable[..., None], written: Callable[[int, int], None] | None,
                 kept: KeptFile | None) -> None:
        self.fd = fd
        self.put = put
        self.written = written
        self.kept = kept


__all__ = ["AttachedFile", "KeptFile", "Slab", "check_writable", "same_file"]
