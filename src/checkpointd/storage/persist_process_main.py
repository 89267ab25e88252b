"""The persist process itself: copies staged bytes from shared slabs into checkpoint files.

Started by :mod:`checkpointd.storage.persist_process` as ``python -P persist_process_main.py SOCKET_FD THREADS
NICE SLICE KEEP``. It imports no torch and nothing of the package but :mod:`checkpointd.codecs.crc`, :mod:`checkpointd.storage.lanes` and
:mod:`checkpointd.storage.fsinfo` (loaded by path),
so it starts in tens of milliseconds and holds little memory. It runs at a lower CPU priority than the
training process, and its threads' GIL, page faults and memory-map lock are its own: that is the point.

Messages on the socket are ``marshal``-encoded tuples behind an 8-byte length (descriptors ride along
as ``SCM_RIGHTS``). Requests:

- ``("map", slab_id, nbytes)`` + the slab's memfd: map it (kept until ``unmap``);
- ``("unmap", slab_id)``;
- ``("write", request_id, end, mode, lanes, tasks, writeback)`` + the open file: put every range of
  ``tasks`` (lists of ``(file_offset, slab_id, slab_offset, length)``) into the file, by ``pwrite`` or
  through a mapping of it (``mode`` ``mmap``; the file is first reserved up to ``end`` with
  ``posix_fallocate``, so a full disk is ENOSPC, never SIGBUS), ``lanes`` tasks at a time, computing
  each range's CRC-32 slice by slice just before the slice is put; with ``writeback``, the disk is
  started on each range once it is in (``sync_file_range``, see ``checkpointd.storage.fsinfo.early_writeback``). Replies ``("ok", request_id, crcs per task)``, ``("oserror", request_id,
  errno, text)`` or ``("error", request_id, text)``;
- ``("scatter", request_id, pieces)`` + the open file: ``pwrite`` each ``(file_offset, bytes)`` of
  ``pieces`` (a file's zip headers and small members, a few hundred per file); replies as ``write``,
  with ``None`` for the CRCs (the requester computed them);
- ``("attach", request_id, end, mode, writeback)`` + the open file: hold the file for the ``put``
  requests that follow (a file whose bytes arrive piece by piece: the host-budget chunk ring hands
  over each chunk once it holds its bytes). Reserved and mapped once, as ``write`` does; the request id
  names the file from then on. Replies ``("ok", request_id, None)`` or a failure as ``write``;
- ``("put", request_id, file_id, lanes, tasks)``: ``write``'s work on the attached file ``file_id``;
- ``("detach", request_id, file_id)``: let the attached file go (its mapping is kept as after ``write``);
- ``("keep", request_id, nbytes)`` + the open file: reserve it (``posix_fallocate``), map it, fault its
  pages into the mapping (``MADV_POPULATE_WRITE`` where the kernel has it) and keep the mapping as
  after a write: a blank file made ahead of a run's first saves (``checkpointd.storage.recycle.FilesAhead``);
- ``("exclusive", request_id, st_dev, st_ino)``: whether the file's mapping this process keeps (see
  :class:`_KeptFile`) is the only open file of it (a write lease on the kept descriptor), ``None`` if
  it keeps none; replies ``("ok", request_id, True | False | None)``.

Populating a blank file (``keep``) is background work: it goes in ranges of
:data:`BACKGROUND_RANGE_BYTES` and waits between them while a save writes (a ``write`` request runs or a
file is attached), so that it never holds up a save (see :meth:`Server.populate_in_background`).

Every file a request sends is checked before a byte goes in (:func:`check_writable`): a regular file
with no other hard link, else the request fails with ``EPERM``. The process opens no path itself.

The process exits when the socket closes (its parent exited or closed it) or on ``("exit",)``.
"""

from __future__ import annotations

import ctypes
import errno
import importlib.util
import marshal
import mmap
import os
import socket
import stat
import struct
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

try:
    import fcntl
except ImportError:  # not POSIX: the process never runs there (it needs memfd), but this module is imported
    fcntl = None  # type: ignore[assignment]

HEADER = struct.Struct("<Q")
MAX_FDS = 4
MAX_KEPT_FILES = 64
"""Kept mappings beyond this many are let go, least recently written first."""
MADV_POPULATE_WRITE = 23
"""Linux 5.14+: fault every page of a range in for writing (``mmap`` has no name for it before 3.13)."""
PRUNE_INTERVAL_S = 0.5
"""How often the mappings of deleted files are let go (a deleted file's pages are freed only then)."""
BACKGROUND_RANGE_BYTES = 64 << 20
"""A blank file is populated this much at a time (~20 ms on an H200 host's tmpfs), then the populating
checks whether a save is writing."""
BACKGROUND_WAIT_S = 60.0
"""The longest the populating waits for saves before a range (a file attached by a requester that
never detaches it must not stop it for good)."""


def send_message(sock: socket.socket, message: tuple, fds: list[int] | None = None) -> None:
    """One message: the length, then the ``marshal`` payload; ``fds`` travel with its first byte."""
    payload = marshal.dumps(message)
    data = HEADER.pack(len(payload)) + payload
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))] if fds else []
    sent = sock.sendmsg([data], anc)
    if sent < len(data):
        sock.sendall(data[sent:])


def receive_message(sock: socket.socket) -> tuple[tuple | None, list[int]]:
    """The next message and the descriptors sent with it; ``(None, [])`` at end of stream.

    A peer that died with answers it had not read yet (a training process killed by a preemption's
    SIGKILL) resets the connection instead of closing it: that is an end of stream too, not an error
    (it printed a traceback from this process into the job's log after every such kill).
    """
    fds: list[int] = []
    try:
        return _receive(sock, fds)
    except ConnectionResetError:
        for fd in fds:
            os.close(fd)
        return None, []


def _receive(sock: socket.socket, fds: list[int]) -> tuple[tuple | None, list[int]]:
    head = b""
    while len(head) < HEADER.size:
        data, anc, _flags, _addr = sock.recvmsg(HEADER.size - len(head), socket.CMSG_SPACE(MAX_FDS * 4))
        for level, kind, blob in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                usable = len(blob) - len(blob) % 4
                fds.extend(struct.unpack(f"{usable // 4}i", blob[:usable]))
        if not data:
            for fd in fds:
                os.close(fd)
            return None, []
        head += data
    (size,) = HEADER.unpack(head)
    body = bytearray(size)
    view = memoryview(body)
    got = 0
    while got < size:
        n = sock.recv_into(view[got:], size - got)
        if n == 0:
            for fd in fds:
                os.close(fd)
            return None, []
        got += n
    return marshal.loads(bytes(body)), fds


def _load_sibling(name: str) -> Any:
    """The package's module ``name`` loaded by path (it must use the standard library only)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_checkpointd_persist_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Slab:
    def __init__(self, fd: int, nbytes: int) -> None:
        self.mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.view = memoryview(self.mapping)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.mapping))
        self.nbytes = nbytes


class _KeptFile:
    """One file's shared mapping, kept after its write for the next write into the same file.

    Why: a save on a memory file system fills its files through a mapping, and a new mapping of a
    4.8 GB file takes 1.2 million page faults to fill, then a burst of TLB shootdowns when it is
    unmapped, even when the file's pages exist (recycling: the save writes over a retired file, the
    same inode). Kept, the next save into that file finds every page mapped. Measured on an H200 host
    (``benchmarks/RESULTS.md``, session 17): the writing took 0.16-0.19 s instead of 0.37-0.45 s, with
    no faults or shootdowns.

    What it costs: page tables (2 MiB per GiB mapped) and a descriptor; the file's pages are the file's
    own. A deleted file's pages are freed only when its mapping goes, so :meth:`Server.prune` lets go of
    unlinked files every :data:`PRUNE_INTERVAL_S`. The kept descriptor makes the file look open to
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


def _same_file(fd: int, st: os.stat_result) -> bool:
    """``fd`` is open on the live file ``st`` describes: same device and inode number (which a deleted
    file, or a 32-bit tmpfs inode counter that wrapped, could share), linked, and the same change time
    and size (one inode read twice in a row)."""
    try:
        mine = os.fstat(fd)
    except OSError:
        return False
    return (mine.st_nlink > 0 and (mine.st_dev, mine.st_ino, mine.st_ctime_ns, mine.st_size)
            == (st.st_dev, st.st_ino, st.st_ctime_ns, st.st_size))


class _Attached:
    """A file held between ``attach`` and ``detach``: our descriptor, how bytes are put into it, and the
    kept mapping it was checked out with (if any)."""

    def __init__(self, fd: int, put: Callable[..., None], written: Callable[[int, int], None] | None,
                 kept: _KeptFile | None) -> None:
        self.fd = fd
        self.put = put
        self.written = written
        self.kept = kept


class Server:
    def __init__(self, sock: socket.socket, threads: int, slice_bytes: int, keep: bool = True) -> None:
        self.sock = sock
        self.pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="persist")
        self.slice = max(4096, slice_bytes)
        self.slabs: dict[int, _Slab] = {}
        self.send_lock = threading.Lock()
        self.writes: set[threading.Thread] = set()
        self.crc32 = _load_sibling("crc").crc32
        self.run_in_lanes = _load_sibling("lanes").run_in_lanes
        fsinfo = _load_sibling("fsinfo")
        self.writeback_starter = fsinfo.writeback_starter
        self.pwrite_all = fsinfo.pwrite_all
        self.keep = keep
        """Keep each written file's mapping (:class:`_KeptFile`); else map it for its write only."""
        self.kept: dict[tuple[int, int], _KeptFile] = {}
        """Kept mappings by ``(st_dev, st_ino)``, least recently written first; one being written is out."""
        self.kept_lock = threading.Lock()
        self.attached: dict[int, _Attached] = {}
        """Files held for ``put`` requests, by the id of the ``attach`` request."""
        self.stopping = threading.Event()
        """Set once no request will come: pruning ends and background populating stops waiting."""
        self._saving = 0
        """Writes in progress: ``write`` requests running and files attached."""
        self._quiet = threading.Condition()
        if self.keep:
            threading.Thread(target=self._prune_often, name="persist-prune", daemon=True).start()

    def reply(self, message: tuple) -> None:
        try:
            with self.send_lock:
                send_message(self.sock, message)
        except OSError:
            pass  # the requester is gone; nobody waits for this answer

    def serve(self) -> None:
        try:
            self._serve()
        finally:
            with self._quiet:  # background work stops waiting for saves that will never end
                self.stopping.set()
                self._quiet.notify_all()
            for thread in list(self.writes):  # writes already started finish before the process exits
                thread.join()

    def _serve(self) -> None:
        while True:
            message, fds = receive_message(self.sock)
            if message is None or message[0] == "exit":
                return
            kind = message[0]
            if kind == "map":
                slab_id, nbytes = message[1], message[2]
                try:
                    self.slabs[slab_id] = _Slab(fds[0], nbytes)
                except (OSError, ValueError):
                    pass  # writes that name this slab fail with "not mapped"; the requester writes them itself
                finally:
                    os.close(fds[0])
            elif kind == "unmap":
                self.slabs.pop(message[1], None)  # unmapped when the last task using it lets go
            elif kind == "exclusive":
                self.reply(("ok", message[1], self.exclusive((message[2], message[3]))))
            elif kind == "detach":
                self.detach(message)
            elif kind in ("write", "scatter", "attach", "put", "keep"):
                handlers: dict[str, Callable[[tuple, Any], None]] = {
                    "write": self.write, "scatter": self.scatter, "attach": self.attach, "put": self.put,
                    "keep": self.keep_blank}
                target = handlers[kind]
                thread = threading.Thread(target=target, args=(message, fds[0] if fds else None), daemon=True)
                self.writes.add(thread)
                thread.start()

    def write(self, message: tuple, fd: int) -> None:
        _kind, request_id, end, mode, lanes, tasks = message[:6]
        writeback = bool(message[6]) if len(message) > 6 else False
        self._answer(request_id, fd, lambda: self._write(fd, end, mode, lanes, tasks, writeback))

    def attach(self, message: tuple, fd: int) -> None:
        _kind, request_id, end, mode, writeback = message[:5]

        def work() -> None:
            try:
                put, written, kept = self._open(fd, end, mode, bool(writeback))
            except BaseException:
                os.close(fd)
                raise
            self.attached[request_id] = _Attached(fd, put, written, kept)
            self._count_saving(1)

        self._answer(request_id, None, work)

    def put(self, message: tuple, _fd: None) -> None:
        _kind, request_id, file_id, lanes, tasks = message[:5]

        def work() -> list[list[int]]:
            target = self.attached.get(file_id)
            if target is None:
                raise ValueError(f"file {file_id} is not attached")
            return self.run_in_lanes([self._task(t, target.put, target.written) for t in tasks], self.pool, lanes)

        self._answer(request_id, None, work)

    def detach(self, message: tuple) -> None:
        """On the serving thread: cheap, and ordered after every ``put`` the requester waited for."""
        request_id, file_id = message[1], message[2]

        def work() -> None:
            target = self.attached.pop(file_id, None)
            if target is None:
                return
            try:
                if target.kept is not None:
                    self._checkin(target.kept)
            finally:
                os.close(target.fd)
                self._count_saving(-1)

        self._answer(request_id, None, work, track=False)

    def keep_blank(self, message: tuple, fd: int) -> None:
        request_id, nbytes = message[1], message[2]

        def work() -> None:
            _put, _written, entry = self._open(fd, nbytes, "mmap", False)  # reserved and mapped as for a write
            if entry is None:
                return
            if self.keep:
                self.populate_in_background(entry)
            self._checkin(entry)  # let go of at once where mappings are not kept

        self._answer(request_id, fd, work)

    def scatter(self, message: tuple, fd: int) -> None:
        _kind, request_id, pieces = message[:3]
        self._answer(request_id, fd, lambda: self._scatter(fd, pieces))

    def _scatter(self, fd: int, pieces: list) -> None:
        check_writable(fd)
        for offset, data in pieces:
            self.pwrite_all(fd, data, offset)

    def _answer(self, request_id: int, fd: int | None, work: Callable[[], Any], track: bool = True) -> None:
        """Run one request on this thread and reply with its result or its failure.

        ``fd`` (if any) is closed before the reply: once the requester has it, this process holds no
        open file of that file but a kept mapping's (retention's ``exclusive`` check may follow at
        once) or an attached file's. ``track``: the request runs on a thread of :attr:`writes`.
        """
        try:
            try:
                result = work()
            finally:
                if fd is not None:
                    os.close(fd)
        except OSError as exc:
            self.reply(("oserror", request_id, exc.errno or 0, str(exc)))
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the requester
            self.reply(("error", request_id, f"{type(exc).__name__}: {exc}"))
        else:
            self.reply(("ok", request_id, result))
        finally:
            if track:
                self.writes.discard(threading.current_thread())

    def _open(self, fd: int, end: int, mode: str, writeback: bool
              ) -> tuple[Callable[[_Slab, int, int, int], None], Callable[[int, int], None] | None, _KeptFile | None]:
        """How to put bytes into ``fd`` (``put(slab, start, n, offset)``), its writeback starter and the
        mapping checked out for it (``mmap`` mode; the caller checks it in when done)."""
        check_writable(fd)
        kept = None
        if mode == "mmap" and end > 0:
            # Reserved first, so a full disk is ENOSPC here and never SIGBUS in a copy. (Reserving each
            # range with MADV_POPULATE_WRITE from the lanes instead was 3x slower on an H200 host's tmpfs.)
            os.posix_fallocate(fd, 0, end)
            kept = self._checkout(fd, end)
        if kept is not None:
            base = kept.base

            def put(slab: _Slab, start: int, n: int, offset: int) -> None:
                ctypes.memmove(base + offset, slab.address + start, n)  # ctypes calls drop the GIL
        else:
            def put(slab: _Slab, start: int, n: int, offset: int) -> None:
                self.pwrite_all(fd, slab.view[start:start + n], offset)

        return put, self.writeback_starter(fd) if writeback else None, kept

    def _write(self, fd: int, end: int, mode: str, lanes: int, tasks: list, writeback: bool) -> list[list[int]]:
        self._count_saving(1)
        try:
            put, written, kept = self._open(fd, end, mode, writeback)
            try:
                return self.run_in_lanes([self._task(t, put, written) for t in tasks], self.pool, lanes)
            finally:
                if kept is not None:
                    self._checkin(kept)
        finally:
            self._count_saving(-1)

    # -- background populating ---------------------------------------------------------------------------

    def _count_saving(self, delta: int) -> None:
        with self._quiet:
            self._saving += delta
            if self._saving <= 0:
                self._quiet.notify_all()

    def populate_in_background(self, entry: _KeptFile) -> None:
        """Fault a blank file's pages into its kept mapping (``MADV_POPULATE_WRITE``) range by range,
        waiting while a save writes.

        Why ranges and waits: one advice over a whole blank file (3.2 GB: 1.2-1.6 s on an H200 host's
        tmpfs, one thread at this process's priority) held up a save that came meanwhile: its first
        file was answered only once the advice ended (0.48 s later), and its writes beside the advice
        ran at a third to a fifth of their rate. The first save of a host-budget run then stalled
        training 0.83-1.32 s against 0.25-0.29 s for the next ones; with the waits 0.41-0.49 s
        (``benchmarks/RESULTS.md``, session 23). Between ranges the memory-map lock is free and
        nothing here competes with the save. A kernel without the advice leaves the faults to the
        first write.
        """
        for start in range(0, entry.nbytes, BACKGROUND_RANGE_BYTES):
            with self._quiet:
                self._quiet.wait_for(lambda: self._saving <= 0 or self.stopping.is_set(), timeout=BACKGROUND_WAIT_S)
                if self.stopping.is_set():
                    return
            try:
                entry.mapping.madvise(MADV_POPULATE_WRITE, start, min(BACKGROUND_RANGE_BYTES, entry.nbytes - start))
            except (OSError, ValueError):
                return

    # -- kept mappings ------------------------------------------------------------------------------------

    def _checkout(self, fd: int, end: int) -> _KeptFile:
        """The kept mapping of ``fd``'s file if it covers ``end`` bytes, else a new one; out of the table
        while it is written."""
        st = os.fstat(fd)
        with self.kept_lock:
            entry = self.kept.pop((st.st_dev, st.st_ino), None)
        if entry is not None and (entry.nbytes < end or not _same_file(entry.fd, st)):
            entry.close()  # too small, or another file under a reused inode number: never written into
            entry = None
        return entry if entry is not None else _KeptFile(fd, end)

    def _checkin(self, entry: _KeptFile) -> None:
        """Keep ``entry`` for the next write into its file (or let it go: turned off, too many)."""
        if not self.keep:
            entry.close()
            return
        try:
            st = os.fstat(entry.fd)
        except OSError:
            entry.close()
            return
        evicted = []
        with self.kept_lock:
            old = self.kept.pop((st.st_dev, st.st_ino), None)
            if old is not None:
                evicted.append(old)
            self.kept[(st.st_dev, st.st_ino)] = entry
            while len(self.kept) > MAX_KEPT_FILES:
                evicted.append(self.kept.pop(next(iter(self.kept))))
        for e in evicted:
            e.close()

    def exclusive(self, key: tuple[int, int]) -> bool | None:
        """Whether the kept mapping of file ``key`` is its only open file; ``None`` if none is kept."""
        with self.kept_lock:
            entry = self.kept.get(key)
            if entry is None or entry.unlinked():
                return None
            return entry.exclusive()

    def prune(self) -> None:
        """Let go of the mappings of deleted files, so their pages are freed."""
        with self.kept_lock:
            gone = [key for key, entry in self.kept.items() if entry.unlinked()]
            entries = [self.kept.pop(key) for key in gone]
        for entry in entries:
            entry.close()

    def _prune_often(self) -> None:
        while not self.stopping.wait(PRUNE_INTERVAL_S):
            self.prune()

    def _task(self, task: list, put: Callable[[_Slab, int, int, int], None],
              written: Callable[[int, int], None] | None) -> Callable[[], list[int]]:
        def run() -> list[int]:
            crcs = []
            for offset, slab_id, start, length in task:
                slab = self.slabs.get(slab_id)
                if slab is None or start + length > slab.nbytes:
                    raise ValueError(f"slab {slab_id} is not mapped or too small for [{start}, {start + length})")
                crc = 0
                for pos in range(0, length, self.slice):
                    n = min(self.slice, length - pos)
                    crc = self.crc32(slab.view[start + pos:start + pos + n], crc)
                    put(slab, start + pos, n, offset + pos)
                crcs.append(crc)
                if written is not None:
                    written(offset, length)
            return crcs
        return run


def lower_priority(nice: int) -> str:
    """Run this process's threads only on cores the training leaves idle (``SCHED_IDLE``), else niced.

    ``SCHED_IDLE``: a normal thread waking on a core that a persist thread occupies preempts it at
    once, so the training's latency-sensitive threads (the Python loop, NCCL's proxy) never wait for
    a time slice. Threads inherit it from this one, so it is set before the pool starts.
    """
    if nice <= 0:
        return "normal"
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        return "idle"
    except (AttributeError, OSError):
        pass
    try:
        os.nice(nice)
    except OSError:
        return "normal"
    return f"nice {nice}"


def main(argv: list[str]) -> int:
    sock_fd, threads, nice, slice_bytes = (int(a) for a in argv[1:5])
    keep = len(argv) <= 5 or argv[5] != "0"
    lower_priority(nice)
    sock = socket.socket(fileno=sock_fd)
    try:
        Server(sock, threads, slice_bytes, keep).serve()
    finally:
        sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
