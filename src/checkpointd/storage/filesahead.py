"""Blank files made ahead in the recycling bin for a run's first saves, on a background thread.

A save writes over a retired checkpoint's files (:mod:`checkpointd.storage.recycle`), but the first
saves of a run have none; :class:`FilesAhead` makes blank ones for them.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from checkpointd.storage import fsinfo
from checkpointd.storage import recyclebin
from checkpointd.storage.recyclebin import (CHECKING_SUFFIX, O_CLOEXEC, O_NOFOLLOW, READY_SUFFIX, bin_dir, bin_entries, open_bin,
                                            unlink_at)

logger = logging.getLogger("checkpointd")

FILES_AHEAD_SETS = 2
"""Sets of blank files made ahead of a run's first saves (:meth:`FilesAhead.sets_wanted`); 0: none."""


class FilesAhead:
    """Blank files in the bin for a run's first saves, made on a background thread.

    Why: a save writes over a retired checkpoint's files, but the first saves of a run have none (with
    ``keep_last=1`` the first two), and on tmpfs every page of a new file is allocated and zeroed while
    the save writes it. Under a host staging budget, where training waits for the writes, the first two
    saves of a 4.83 GB state stall 650-900 ms into new files against 283-330 over retired ones (H200);
    the default path persists new files at 0.5-0.6x the rate over retired ones. So the files are made
    once the state's layout is known (after the staging buffers): one per large file of a save, ``sets``
    times (default :data:`FILES_AHEAD_SETS`: the first two saves; a run keeps that many checkpoints'
    files from its second save on anyway), each a little larger than its tensors
    (:func:`checkpointd.storage.ptlayout.write_file` sets the exact size); what a layout that changes
    ahead of the first save (the optimizer's state appearing) is missing is made then (:meth:`want`). On
    memory file systems the persist process makes them (reserved, mapped with their pages in, at its
    idle priority) and keeps the mappings, so the first save writes as fast as later ones; elsewhere
    this thread reserves them (``posix_fallocate``), and on a memory file system where the persist
    process keeps no mappings (several ranks on the host) also writes them with zeros (:meth:`_write_zeros`).

    Nothing is made while ``busy()`` says staging buffers are being prepared or a save writes (checked
    ahead of each file, and between the zeros written over one): making files beside their page-locking
    slows both, and training with them (on an H200 host the steps ahead of the first save take 352 ms
    more in all with files made meanwhile against 115 without, the registration 1.29 s against 0.79),
    and a save's writes share the same memory. Nothing is made where the bin already holds files (a
    previous run's, taken first) or recycling does not apply. Ranks of one host share the bin, and each
    makes its own files: a blank file is named after the process making it (:func:`ahead_name`), and
    files that another running process is making ahead are not a previous run's (:meth:`_bin_ready`);
    otherwise the first rank to start would make its files and the others would find the bin in use.
    A save takes any file that fits, whichever rank made it. On any failure (a full disk) the file
    being made is removed and no more are made.

    Only files that a save will still take are made (``saves_started``): set k is for save k + 1, so
    once that save has begun without it, it is not made, and a file this thread is writing zeros over
    for it is given up (removed at once; one the persist process is faulting in is finished). Why:
    saves that come ahead of their files (back to back, or while the files wait for the staging
    buffers) write new files anyway, and blank ones finished after them would be deleted by the next
    retirement, on the committing save's time (0.43 s of a 0.86 s save over retired files on an H200
    host, 4.83 GB). Retention's next retirement deletes what no save took, ``close()`` empties the bin.
    """

    def __init__(self, store: Any, sizes: Sequence[int], sets: int,
                 premap: Callable[[int, int], bool] | None = None, busy: Callable[[], bool] | None = None,
                 saves_started: Callable[[], int] | None = None) -> None:
        """``premap(fd, nbytes)``: reserves and maps the file elsewhere (the persist process) and returns
        True, or returns False to have it reserved here. ``busy()``: while True, no file is begun.
        ``saves_started()``: how many saves the manager has begun (None: every set is made)."""
        self.directory = bin_dir(store)
        self.sets = sets
        self.premap = premap
        self.busy = busy
        self.saves_started = saves_started
        self._ready_paths: list[tuple[str, int]] = []
        """(bin path, size) of every file made; one that is gone was taken by a save."""
        self.given_up = 0
        """Files begun and removed because the save they were for had begun without them (tests, stats)."""
        self._lock = threading.Lock()
        self._sizes = self._large(sizes)
        self._stop = threading.Event()
        """Set by :meth:`stop`, a failure, or a bin that held files: nothing more is made."""
        self._thread: threading.Thread | None = None
        self._bin_checked = False

    @property
    def made(self) -> list[int]:
        """Sizes of the files made so far, in order (tests, stats)."""
        with self._lock:
            return [n for _, n in self._ready_paths]

    @staticmethod
    def _large(sizes: Sequence[int]) -> list[int]:
        return sorted((n for n in sizes if n >= recyclebin.MIN_RECYCLE_BYTES), reverse=True)

    @property
    def sizes(self) -> list[int]:
        """One save's blank-file sizes, largest first."""
        with self._lock:
            return list(self._sizes)

    @staticmethod
    def sets_wanted() -> int:
        """Sets of blank files a manager makes ahead (:data:`FILES_AHEAD_SETS`)."""
        return max(0, FILES_AHEAD_SETS)

    def start(self) -> None:
        """Start making the missing files on a background thread (none where all are made or it stopped)."""
        with self._lock:
            if self._thread is None and not self._stop.is_set() and self._next() is not None:
                self._thread = threading.Thread(target=self._run, name="checkpointd-files-ahead", daemon=True)
                self._thread.start()

    def want(self, sizes: Sequence[int]) -> None:
        """A save's files now have these sizes: make what is missing for them.

        Why: the staging buffers (and this) are first prepared when the manager first sees the state,
        which for a resumed or fresh run (``restore_latest()`` ahead of the first step) has no optimizer
        state yet; its file, the largest (twice the parameters for Adam), comes later and would get no
        blank file. Files already made for a size still wanted count; others stay in the
        bin (a save takes them where they fit).
        """
        with self._lock:
            self._sizes = self._large(sizes)
        self.start()

    def wait(self, timeout: float | None = None) -> None:
        """Wait for every file to be made (or the making to stop), at most ``timeout`` seconds."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def stop(self) -> None:
        """Make no more files and wait for the one being made (the bin is emptied next)."""
        self._stop.set()
        self.wait()

    def _next(self) -> int | None:
        """The size of the next file to make: the first one missing when the wanted sizes are made
        ``sets`` times over, one save's set after the other (the first save's first); with
        ``saves_started``, only the sets of saves not yet begun, against the files made and not yet
        taken. The caller holds the lock."""
        sets, have = self._wanted()
        for _ in range(sets):
            for nbytes in self._sizes:
                if have[nbytes] > 0:
                    have[nbytes] -= 1
                else:
                    return nbytes
        return None

    def _wanted(self) -> tuple[int, collections.Counter]:
        """(sets still wanted, files of each size that count towards them)."""
        if self.saves_started is None:
            return self.sets, collections.Counter(n for _, n in self._ready_paths)
        waiting = collections.Counter(n for path, n in self._ready_paths if os.path.lexists(path))
        return max(0, self.sets - self.saves_started()), waiting

    def _still_wanted(self, nbytes: int) -> bool:
        """Whether a file of ``nbytes`` being made (not yet in the bin) will still be taken by a save."""
        with self._lock:
            sets, have = self._wanted()
        return sets * self._sizes.count(nbytes) > have[nbytes]

    def _run(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)  # this thread only (Linux)
        except (AttributeError, OSError):
            pass
        while True:
            if not self._idle():
                return  # stopped
            if not self._bin_ready():
                self._stop.set()
                return
            with self._lock:
                nbytes = self._next()
                if nbytes is None:
                    self._thread = None  # all made: a later ``want`` starts a new thread
                    return
            if not self._make(nbytes):
                self._stop.set()  # a full disk, the bin emptied: saves make their own files
                return

    def _bin_ready(self) -> bool:
        """Once, ahead of the first file: the bin exists and holds no previous run's files (retired ones,
        or blank ones made by a process that is gone or by this one); blank files that other running
        processes (the other ranks of this host) are making do not count."""
        if self._bin_checked:
            return True
        self._bin_checked = True
        if any(not made_by_another_running_process(os.path.basename(path))
               for path, _ in bin_entries(self.directory)):
            return False
        fd = open_bin(self.directory, create=True)  # never a link: blank files are made in the root only
        if fd is None:
            return False
        os.close(fd)
        return True

    def _idle(self) -> bool:
        """Wait while ``busy()``; False once stopped."""
        while self.busy is not None and self.busy():
            if self._stop.wait(0.05):
                return False
        return not self._stop.is_set()

    def _make(self, nbytes: int) -> bool:
        """Make one blank file of ``nbytes`` in the bin; False where no more can be made."""
        name = ahead_name()
        checking = name + CHECKING_SUFFIX  # not taken while it is not whole
        bin_fd = open_bin(self.directory)
        if bin_fd is None:
            return False  # emptied (closed), or replaced by a link: saves make their own files
        try:
            try:
                fd = os.open(checking, os.O_RDWR | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0o644,
                             dir_fd=bin_fd)
            except OSError:
                return False
            try:
                try:
                    if self.premap is None or not self.premap(fd, nbytes):
                        os.posix_fallocate(fd, 0, nbytes)
                        if fsinfo.is_memory_backed(fsinfo.fd_filesystem_type(fd)):
                            self._write_zeros(fd, nbytes)
                finally:
                    os.close(fd)
                os.rename(checking, name + READY_SUFFIX, src_dir_fd=bin_fd, dst_dir_fd=bin_fd)
            except NotWanted:
                unlink_at(bin_fd, checking)
                with self._lock:
                    self.given_up += 1
                return True  # the next ``_next`` says whether any other file is still wanted
            except Exception as exc:  # noqa: BLE001 - a full disk, the bin emptied meanwhile: saves make their own
                logger.debug("checkpointd: no blank file of %d bytes made ahead: %s", nbytes, exc)
                unlink_at(bin_fd, checking)
                return False
        finally:
            os.close(bin_fd)
        with self._lock:
            self._ready_paths.append((os.path.join(self.directory, name + READY_SUFFIX), nbytes))
        return True

    def _write_zeros(self, fd: int, nbytes: int) -> None:
        """Write zeros over a reserved file on a memory file system, :data:`ZERO_WRITE_BYTES` at a time.

        Why: ``fallocate`` on tmpfs allocates a file's pages without touching them; each is cleared at
        its first write, which is the first save's. On the GPU hosts measured, memory the guest has not
        touched comes back from the hypervisor through its page faults (free page reporting), so a save
        into merely reserved blank files writes no faster than into new ones: on two ranks of a 2x H200
        host, 2.42 GB a rank into such files take 0.88 and 1.06 s, against 0.46 and 0.49 s over retired
        files. The persist process's
        blank files (one rank a host) have their pages faulted in for the same reason. Positional writes,
        not a mapping: nothing to unmap in the training process afterwards. Waits while ``busy()``;
        raises if stopped (the caller removes the file).
        """
        zeros = memoryview(bytes(min(ZERO_WRITE_BYTES, nbytes)))
        for offset in range(0, nbytes, len(zeros)):
            if not self._idle():
                raise RuntimeError("stopped")
            if not self._still_wanted(nbytes):
                raise NotWanted
            fsinfo.pwrite_all(fd, zeros[:nbytes - offset], offset)


class NotWanted(Exception):
    """The save this blank file was for has begun without it (:meth:`FilesAhead._still_wanted`)."""


ZERO_WRITE_BYTES = 8 << 20
"""The zeros written at a time over a blank file on a memory file system (:meth:`FilesAhead._write_zeros`)."""

AHEAD_PREFIX = "ahead-"
"""The start of a blank file's name in the bin (:func:`ahead_name`)."""


def ahead_name() -> str:
    """A blank file's name in the bin (without its suffix): ``ahead-<pid>-<uuid>``, the pid of the process
    making it, so that other ranks can tell it from a previous run's leftovers."""
    return f"{AHEAD_PREFIX}{os.getpid()}-{uuid.uuid4().hex}"


def made_by_another_running_process(name: str) -> bool:
    """True if ``name`` is a blank file's (:func:`ahead_name`) made by a live process other than this one.

    Why not by this one: a process starts its files ahead once per manager, so blank files of its own
    pid are a previous manager's on the same root (a leftover, as a retired file is). A live process of
    that pid is another rank of this host in all but one case, a pid reused since a crashed run made the
    file: then this rank makes its files beside the leftovers, and the first retirement deletes what no
    save took.
    """
    if not name.startswith(AHEAD_PREFIX):
        return False
    try:
        pid = int(name[len(AHEAD_PREFIX):].split("-", 1)[0])
    except ValueError:
        return False
    if pid <= 0 or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, another user's
    except OSError:
        return False
    return True


def sizes_ahead(tensor_bytes: Sequence[int]) -> list[int]:
    """Blank-file sizes for files holding ``tensor_bytes`` of tensors each: room for the zip's headers,
    the pickle and alignment too (:func:`checkpointd.storage.recyclebin.take_open` picks the smallest file
    that fits)."""
    return [n + n // 256 + (4 << 20) for n in tensor_bytes]


__all__ = ["AHEAD_PREFIX", "FILES_AHEAD_SETS", "FilesAhead", "NotWanted", "ZERO_WRITE_BYTES", "ahead_name",
           "made_by_another_running_process", "sizes_ahead"]


