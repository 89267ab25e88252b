"""Recycling retired checkpoint files: the next save overwrites them instead of allocating new ones.

Why: on a local target, retention used to delete a retired checkpoint's files and the next save
created new ones of the same size. On tmpfs that frees every page of gigabytes and allocates (and
zeroes) them again a few seconds later; on the GPU hosts measured (Firecracker VMs with free page
reporting) the freed pages even go back to the host and come back through its page faults. Measured on
an H200 host, 4.3 GB in 8 threads: a new tmpfs file took 0.4 s to reserve and 0.45 s to fill, plus
0.23 s to delete; overwriting an existing one took 0.07 s and 0.25 s (``benchmarks/RESULTS.md``,
session 10). Writing into pages that exist is also what the rest of the machine notices least.

How: when retention retires a committed step (marker already removed), its large files are renamed
into ``<root>/.checkpointd-recycle/`` instead of being deleted (:func:`retire`); the rest of the
directory is deleted as before. A save creating a large local file renames a retired one to its path
first (:func:`take`) and writes over it; :func:`checkpointd.storage.ptlayout.write_file` sets the exact size.
The bin holds at most what one save writes: each retirement first deletes what the previous one left
unused, and files beyond the size of the step just committed are deleted.

What keeps this safe:
- A file is recycled only if nothing else has it open or mapped (an evaluation job still reading a
  retired checkpoint keeps reading intact bytes, as it would after a deletion): checked with a write
  lease (``F_SETLEASE``), which the kernel grants only when no other open file refers to the file.
  The check runs after the file left its step directory (no new opener can find it) and before it
  gets a name that savers take (``*.bin``; until then ``*.checking``). The persist process keeps its
  mapping of each file it wrote (``persist_process_main._KeptFile``), so it takes that lease on its
  own descriptor; only for files it keeps no mapping of is the lease taken here.
  Where leases are not available (not Linux, a network file system), files are deleted as before.
- Files with other hard links are deleted, never recycled; and a file a save takes is checked on its
  open descriptor right before it is written (a regular file with one link, :func:`take_open`), so a
  hard link or a link planted in the bin is never written through.
- Nothing the bin deletes, renames or writes over lies outside the root, whatever links the root holds:
  the bin and the step directories are opened without following links and every file is moved by
  descriptor. A bin that is a symbolic link (or not a directory) is never used: recycling is skipped
  for that root, with one warning; :func:`empty` (``close()``, ``checkpointd gc``) removes the link
  itself, never its target.
- A recycled file sits in a step directory that has no commit marker until every byte of the new save
  is written and checksummed: a crash midway leaves an uncommitted leftover, as with a new file.
- ``close()`` empties the bin; a bin left by a crash is used (or emptied) by the next run's saves,
  or emptied by ``checkpointd gc`` (a running job then just writes its next save into new files).

``CHECKPOINTD_RECYCLE=0`` turns recycling off (files are deleted, new ones created).

A run's first saves have nothing retired to write over, so blank files for them are made ahead, in the
background, like the pinned staging buffers (:class:`FilesAhead`).
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import stat
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from checkpointd.storage import fsinfo
from checkpointd.storage import localpaths

try:
    import fcntl
except ImportError:  # not POSIX: no leases, no recycling
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger("checkpointd")

RECYCLE_ENV = "CHECKPOINTD_RECYCLE"
FILES_AHEAD_ENV = "CHECKPOINTD_FILES_AHEAD"
"""Sets of blank files made ahead of a run's first saves (:class:`FilesAhead`); default 2, ``0``: none."""
FILES_AHEAD_SETS = 2
BIN_NAME = ".checkpointd-recycle"
"""The bin's directory name under the checkpoint root (not step-shaped: listings ignore it)."""
MIN_RECYCLE_BYTES = 16 << 20
"""Smaller files are deleted as before: recycling them saves nothing worth a rename."""

_READY = ".bin"
"""Bin entries that a save may take; ``_CHECKING`` ones are still being checked for other users."""
_CHECKING = ".checking"

_F_SETLEASE: int | None = getattr(fcntl, "F_SETLEASE", None)  # Linux only


def enabled(store: Any) -> bool:
    """Recycling applies to local stores on Linux, unless ``CHECKPOINTD_RECYCLE=0``."""
    return (_F_SETLEASE is not None and getattr(store, "is_local", False)
            and os.environ.get(RECYCLE_ENV, "1").strip() != "0")


def bin_dir(store: Any) -> str:
    return os.path.join(store.path(""), BIN_NAME)


def bin_for(store: Any) -> str | None:
    """The bin a save on ``store`` may take retired files from; None where recycling does not apply."""
    return bin_dir(store) if enabled(store) else None


def _exclusive(bin_fd: int, name: str) -> bool:
    """True if ``name`` in the bin is a regular file with one link and no open file other than ours
    refers to it (a write lease is granted only then).

    The persist process keeps its mapping of each file it wrote (for the next save into it), so it is
    asked first: it takes the lease on its own descriptor. Only where it keeps none is the lease taken here.
    """
    if _F_SETLEASE is None:
        return False
    from checkpointd.storage import persist_process

    try:
        st = os.stat(name, dir_fd=bin_fd, follow_symlinks=False)
    except OSError:
        return False
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        return False
    held = persist_process.holds_only_open(st)
    if held is not None:
        return held
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | _O_NOFOLLOW | _O_CLOEXEC, dir_fd=bin_fd)
    except OSError:
        return False
    try:
        mine = os.fstat(fd)
        if (mine.st_dev, mine.st_ino) != (st.st_dev, st.st_ino) or mine.st_nlink != 1:
            return False  # replaced meanwhile
        fcntl.fcntl(fd, _F_SETLEASE, fcntl.F_WRLCK)
    except OSError:
        return False  # EAGAIN: opened or mapped elsewhere; EINVAL: no leases on this file system
    else:
        try:
            fcntl.fcntl(fd, _F_SETLEASE, fcntl.F_UNLCK)
        except OSError:
            pass
        return True
    finally:
        os.close(fd)


_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_BIN_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _O_NOFOLLOW | _O_CLOEXEC | os.O_NONBLOCK

_warned_lock = threading.Lock()
_warned: set[str] = set()


def _open_bin(directory: str, create: bool = False) -> int | None:
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


def _scan(dir_fd: int, min_bytes: int = 0) -> list[tuple[str, int]]:
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


def _bin_entries(directory: str) -> list[tuple[str, int]]:
    """``(path, size)`` of the files in the bin that a save could take ([] for an unusable bin)."""
    fd = _open_bin(directory)
    if fd is None:
        return []
    try:
        return [(os.path.join(directory, name), size) for name, size in _scan(fd)]
    finally:
        os.close(fd)


def _large_files_at(dir_fd: int, name: str) -> list[tuple[int, str, int]]:
    """``(directory descriptor, name, size)`` of the large regular files under ``name`` in ``dir_fd``,
    descended without following links (``os.fwalk``); the caller closes nothing: the descriptors are
    duplicated and must be closed by it (see :meth:`Retirement.retire`)."""
    out = []
    for _dirpath, _dirs, _files, fd in os.fwalk(name, dir_fd=dir_fd, follow_symlinks=False):
        found = _scan(fd, MIN_RECYCLE_BYTES)
        if found:
            kept = os.dup(fd)
            out.extend((kept, n, size) for n, size in found)
    return out


def _unlink_at(dir_fd: int, name: str) -> None:
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
    fd = _open_bin(directory)
    if fd is None:
        try:
            if not stat.S_ISDIR(os.lstat(directory).st_mode):
                os.unlink(directory)  # a link or a file planted at the bin's name: the name goes, not its target
        except (FileNotFoundError, NotADirectoryError):
            pass
        return
    _clear_bin(fd)
    try:
        os.rmdir(directory)
    except OSError:
        pass  # absent, or a retirement beside us just put a file in


def _clear_bin(fd: int) -> None:
    """Unlink every non-directory entry of the open bin ``fd`` (names only, never a link's target), then close it."""
    try:
        with os.scandir(fd) as it:
            names = [e.name for e in it if not e.is_dir(follow_symlinks=False)]
        for name in names:
            _unlink_at(fd, name)
    finally:
        os.close(fd)


def contents(store: Any) -> tuple[int, int]:
    """``(files, bytes)`` in the bin (``checkpointd gc`` reports them before emptying it)."""
    entries = _bin_entries(bin_dir(store))
    return len(entries), sum(n for _, n in entries)


class Retirement:
    """One retention pass: moves the large files of retired steps into the bin, up to ``budget`` bytes.

    ``budget`` is the size of the large files of the step just committed (what the next save will
    need) times :data:`RETIRE_SLACK`; whatever the previous pass left in the bin is deleted first.
    Step directories are walked and files moved by descriptor, never through a link: a step directory
    that is a link retires nothing, and with a bin that is a link (or not a directory) nothing is moved.
    """

    def __init__(self, store: Any, just_committed_dir: str) -> None:
        self.dir = bin_dir(store)
        self.store = store
        self.budget = int(sum(size for _, _, size in self._large_files(just_committed_dir, close=True)) * RETIRE_SLACK)
        self.recycled_bytes = 0
        fd = _open_bin(self.dir)  # made only when a step is retired
        if fd is not None:
            _clear_bin(fd)

    def _large_files(self, step_dir: str, close: bool = False) -> list[tuple[int, str, int]]:
        try:
            root_fd = localpaths.open_dir_below(self.store.path(""), [])
        except OSError:
            return []
        try:
            found = _large_files_at(root_fd, step_dir)
        except OSError:
            found = []
        finally:
            os.close(root_fd)
        if close:
            for fd in {fd for fd, _, _ in found}:
                os.close(fd)
        return found

    def retire(self, step_dir: str) -> None:
        """Move ``step_dir``'s large files into the bin (within budget); the caller deletes the rest."""
        found = self._large_files(step_dir)
        bin_fd = None
        try:
            for dir_fd, path, size in sorted(found, key=lambda e: -e[2]):
                if self.recycled_bytes + size > self.budget:
                    continue
                if bin_fd is None:
                    bin_fd = _open_bin(self.dir, create=True)
                    if bin_fd is None:
                        return
                name = uuid.uuid4().hex
                checking = name + _CHECKING  # not taken under this name
                try:
                    os.rename(path, checking, src_dir_fd=dir_fd, dst_dir_fd=bin_fd)
                except OSError:
                    continue
                # Renamed first, so no new opener finds it by its old name; then refused if anyone has it
                # (or it has another link); only then under a name that savers take.
                try:
                    if not _exclusive(bin_fd, checking):
                        raise OSError("in use")
                    os.rename(checking, name + _READY, src_dir_fd=bin_fd, dst_dir_fd=bin_fd)
                except OSError:
                    _unlink_at(bin_fd, checking)
                    continue
                self.recycled_bytes += size
        finally:
            if bin_fd is not None:
                os.close(bin_fd)
            for fd in {fd for fd, _, _ in found}:
                os.close(fd)


RETIRE_SLACK = 1.1
"""A retirement keeps up to this much more than the step just committed wrote. Why: compressed files of
consecutive saves differ by a little; with a budget of exactly the committed bytes, a retired file 0.1 %
larger than its successor was deleted instead of recycled (every zstd save then wrote a new file)."""

TAKE_RATIO = 1.5
"""A file in the bin is taken for ``nbytes`` only if it is at most this many times as large."""


def take(directory: str, path: str, nbytes: int) -> bool:
    """Rename a retired file from the bin ``directory`` to ``path`` (see :func:`take_open`); False if the
    bin has none that fits (or others took them first)."""
    try:
        dir_fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _O_CLOEXEC)
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
    blank files made ahead in the bin, the model's file took the optimizer's (twice its size; cut to
    size, the pages made for it were thrown away) and the optimizer's then found none. Retired and
    blank files are within 1 % of the size they are taken for. Smaller ones are taken (and grown):
    a compressed file's ``nbytes`` is its raw size.
    """
    if nbytes < MIN_RECYCLE_BYTES:
        return None
    bin_fd = _open_bin(directory)
    if bin_fd is None:
        return None
    try:
        entries = [e for e in _scan(bin_fd) if e[0].endswith(_READY) and e[1] <= nbytes * TAKE_RATIO]
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
                fd = os.open(name, os.O_RDWR | os.O_NONBLOCK | _O_NOFOLLOW | _O_CLOEXEC, dir_fd=dir_fd)
            except OSError:
                _unlink_at(dir_fd, name)  # replaced by a link (or worse) meanwhile: never written through
                continue
            if localpaths.writable_here(fd):
                os.set_blocking(fd, True)
                return fd
            os.close(fd)
            _unlink_at(dir_fd, name)  # another link to it exists: someone else's file, never written into
        return None
    finally:
        os.close(bin_fd)


class FilesAhead:
    """Blank files in the bin for a run's first saves, made on a background thread.

    Why: a save writes over a retired checkpoint's files (above), but the first saves of a run have none
    (with ``keep_last=1`` the first two), and on tmpfs every page of a new file is allocated and zeroed
    while the save writes it. Under a host staging budget, where training waits for the writes, the
    first two saves of the 4.83 GB reference stalled 650-900 ms against 283-330 over retired files (H200,
    ``benchmarks/RESULTS.md``, session 22); the default path persists new files at 0.5-0.6x the rate over
    retired ones. So the files are made once the state's layout is known (after the staging buffers): one
    per large file of a save, ``sets`` times (default :data:`FILES_AHEAD_SETS`: the first two saves; a
    run keeps that many checkpoints' files from its second save on anyway), each a little larger than its
    tensors (:meth:`write_file` sets the exact size); what a layout that changes before the first save
    (the optimizer's state appearing) is missing is made then (:meth:`want`). On memory file systems
    the persist process makes them (reserved, mapped with their pages in, at its idle priority) and
    keeps the mappings, so the first save writes as fast as later ones; elsewhere this thread reserves
    them (``posix_fallocate``), and on a memory file system where the persist process keeps no mappings
    (several ranks on the host) also writes them with zeros (:meth:`_write_zeros`).

    Nothing is made while ``busy()`` says staging buffers are being prepared or a save writes (checked
    before each file, and between the zeros written over one): making files beside their page-locking
    slowed both, and training with them (the default path's steps before its first save: 352 ms more
    in all against 115 without files ahead, the registration 1.29 s against 0.79; H200,
    ``benchmarks/RESULTS.md``, session 23), and a save's writes share the same memory. Nothing is made
    where the bin already holds files (a previous run's, taken first) or recycling does not apply.
    Ranks of one host share the bin, and each makes its own files: a blank file is named after the
    process making it (:func:`_ahead_name`), and files that another running process is making ahead are
    not a previous run's (:meth:`_bin_ready`). Until session 25 the first rank to start made its files
    and the others found the bin in use, so their first saves wrote new files. A save takes any file
    that fits, whichever rank made it. On any failure (a full disk) the file being made is removed and
    no more are made.

    Only files that a save will still take are made (``saves_started``): set k is for save k + 1, so
    once that save has begun without it, it is not made, and a file this thread is writing zeros over
    for it is given up (removed at once; one the persist process is faulting in is finished). Why:
    saves that come before their files are ready (back to back, or while the files wait for the
    staging buffers) wrote new files anyway, and the blank ones finished after them were deleted by
    the next retirement, on the committing save's time: 0.43 s of a 0.86 s save over
    retired files on an H200 host (4.83 GB, ``bench_persist.py``'s ``checkpointd_recycle``,
    ``benchmarks/RESULTS.md``, session 26), 0.65 s on the CPU VM.
    Retention's next retirement deletes what no save took, ``close()`` empties the bin.
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
        return sorted((n for n in sizes if n >= MIN_RECYCLE_BYTES), reverse=True)

    @property
    def sizes(self) -> list[int]:
        """One save's blank-file sizes, largest first."""
        with self._lock:
            return list(self._sizes)

    @staticmethod
    def sets_wanted() -> int:
        try:
            return max(0, int(os.environ.get(FILES_AHEAD_ENV, "") or FILES_AHEAD_SETS))
        except ValueError:
            return FILES_AHEAD_SETS

    def start(self) -> None:
        with self._lock:
            if self._thread is None and not self._stop.is_set() and self._next() is not None:
                self._thread = threading.Thread(target=self._run, name="checkpointd-files-ahead", daemon=True)
                self._thread.start()

    def want(self, sizes: Sequence[int]) -> None:
        """A save's files now have these sizes: make what is missing for them.

        Why: the staging buffers (and this) are first prepared when the manager first sees the state,
        which for a resumed or fresh run (``restore_latest()`` before the first step) is before the
        optimizer has any state; its file, the largest (twice the parameters for Adam), came later
        and got no blank file. Files already made for a size still wanted count; others stay in the
        bin (a save takes them where they fit).
        """
        with self._lock:
            self._sizes = self._large(sizes)
        self.start()

    def wait(self, timeout: float | None = None) -> None:
        """Until every file is made (or the making stopped)."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def stop(self) -> None:
        """Make no more files and wait for the one being made (before the bin is emptied)."""
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
        """Once, before the first file: the bin exists and holds no previous run's files (retired ones,
        or blank ones made by a process that is gone or by this one); blank files that other running
        processes (the other ranks of this host) are making do not count."""
        if self._bin_checked:
            return True
        self._bin_checked = True
        if any(not _made_by_another_running_process(os.path.basename(path))
               for path, _ in _bin_entries(self.directory)):
            return False
        fd = _open_bin(self.directory, create=True)  # never a link: blank files are made in the root only
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
        name = _ahead_name()
        checking = name + _CHECKING  # not taken before it is whole
        bin_fd = _open_bin(self.directory)
        if bin_fd is None:
            return False  # emptied (closed), or replaced by a link: saves make their own files
        try:
            try:
                fd = os.open(checking, os.O_RDWR | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC, 0o644,
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
                os.rename(checking, name + _READY, src_dir_fd=bin_fd, dst_dir_fd=bin_fd)
            except _NotWanted:
                _unlink_at(bin_fd, checking)
                with self._lock:
                    self.given_up += 1
                return True  # the next ``_next`` says whether any other file is still wanted
            except Exception as exc:  # noqa: BLE001 - a full disk, the bin emptied meanwhile: saves make their own
                logger.debug("checkpointd: no blank file of %d bytes made ahead: %s", nbytes, exc)
                _unlink_at(bin_fd, checking)
                return False
        finally:
            os.close(bin_fd)
        with self._lock:
            self._ready_paths.append((os.path.join(self.directory, name + _READY), nbytes))
        return True

    def _write_zeros(self, fd: int, nbytes: int) -> None:
        """Write zeros over a reserved file on a memory file system, :data:`ZERO_WRITE_BYTES` at a time.

        Why: ``fallocate`` on tmpfs allocates a file's pages without touching them; each is cleared at
        its first write, which is the first save's. On the GPU hosts measured, memory the guest has not
        touched comes back from the hypervisor through its page faults (free page reporting), so a save
        into reserved blank files wrote no faster than into new ones: on two ranks of a 2x H200 host, both
        ranks' first saves took their files from the bin and wrote 2.42 GB in 0.88 and 1.06 s, against
        0.46 and 0.49 s over retired files (``benchmarks/RESULTS.md``, session 25). The persist process's
        blank files (one rank a host) have their pages faulted in for the same reason. Positional writes,
        not a mapping: nothing to unmap in the training process afterwards. Waits while ``busy()``;
        raises if stopped (the caller removes the file).
        """
        zeros = memoryview(bytes(min(ZERO_WRITE_BYTES, nbytes)))
        for offset in range(0, nbytes, len(zeros)):
            if not self._idle():
                raise RuntimeError("stopped")
            if not self._still_wanted(nbytes):
                raise _NotWanted
            fsinfo.pwrite_all(fd, zeros[:nbytes - offset], offset)


class _NotWanted(Exception):
    """The save this blank file was for has begun without it (:meth:`FilesAhead._still_wanted`)."""


ZERO_WRITE_BYTES = 8 << 20
"""The zeros written at a time over a blank file on a memory file system (:meth:`FilesAhead._write_zeros`)."""

_AHEAD_PREFIX = "ahead-"


def _ahead_name() -> str:
    """A blank file's name in the bin (before its suffix): ``ahead-<pid>-<uuid>``, the pid of the process
    making it, so that other ranks can tell it from a previous run's leftovers."""
    return f"{_AHEAD_PREFIX}{os.getpid()}-{uuid.uuid4().hex}"


def _made_by_another_running_process(name: str) -> bool:
    """True if ``name`` is a blank file's (:func:`_ahead_name`) made by a live process other than this one.

    Why not by this one: a process starts its files ahead once per manager, so blank files of its own
    pid are a previous manager's on the same root (a leftover, as a retired file is). A live process of
    that pid is another rank of this host in all but one case, a pid reused since a crashed run made the
    file: then this rank makes its files beside the leftovers, and the first retirement deletes what no
    save took.
    """
    if not name.startswith(_AHEAD_PREFIX):
        return False
    try:
        pid = int(name[len(_AHEAD_PREFIX):].split("-", 1)[0])
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
    the pickle and alignment too (:func:`take` picks the smallest file that fits)."""
    return [n + n // 256 + (4 << 20) for n in tensor_bytes]


__all__ = ["BIN_NAME", "FILES_AHEAD_ENV", "FILES_AHEAD_SETS", "FilesAhead", "MIN_RECYCLE_BYTES", "RECYCLE_ENV", "RETIRE_SLACK", "Retirement", "TAKE_RATIO", "ZERO_WRITE_BYTES",
           "bin_dir", "bin_for", "contents", "empty", "enabled", "sizes_ahead", "take"]
