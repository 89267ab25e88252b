"""The persist process itself: copies staged bytes from shared slabs into checkpoint files.

Started by :mod:`checkpointd.storage.persist_process` as ``python -P persist_process_main.py SOCKET_FD THREADS
NICE SLICE KEEP``. It imports no torch and, to write native files, nothing of the package: it loads by
path the few standard-library modules it needs (:mod:`checkpointd.storage.persist_protocol`,
:mod:`checkpointd.storage.persist_mappings`, :mod:`checkpointd.codecs.crc`, :mod:`checkpointd.storage.lanes`
and :mod:`checkpointd.storage.fsinfo`), so it starts in tens of milliseconds and holds little memory.
A compressed file's first ``encode`` request imports the codecs (:mod:`checkpointd.storage.persist_codecs`:
NumPy, zstandard, the native plane kernels; still no torch). It runs at a lower CPU priority than the training process, and its
threads' GIL, page faults and memory-map lock are its own: that is the point.

The requests it serves are listed in :mod:`checkpointd.storage.persist_protocol`.

Populating a blank file (``keep``) is background work: it goes in ranges of
:data:`BACKGROUND_RANGE_BYTES` and waits between them while a save writes (a ``write`` request runs or a
file is attached), so that it never holds up a save (see :meth:`Server.populate_in_background`).

Every file a request sends is checked before a byte goes in (``check_writable``): a regular file
with no other hard link, else the request fails with ``EPERM``. The process opens no path itself.

The process exits when the socket closes (its parent exited or closed it) or on ``("exit",)``.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import socket
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(relative: str) -> Any:
    """The package's module at ``relative`` (a path below the package directory) loaded by path; it must
    use the standard library only."""
    path = os.path.join(_PACKAGE_DIR, *relative.split("/"))
    name = "_checkpointd_persist_" + relative.replace("/", "_").removesuffix(".py")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_protocol = _load("storage/persist_protocol.py")
_held = _load("storage/persist_mappings.py")
_codecs = _load("storage/persist_codecs.py")
send_message = _protocol.send_message
receive_message = _protocol.receive_message
Slab = _held.Slab
KeptFile = _held.KeptFile
AttachedFile = _held.AttachedFile
check_writable = _held.check_writable
same_file = _held.same_file

MAX_KEPT_FILES = 64
"""Kept mappings beyond this many are let go, least recently written first."""
MADV_POPULATE_WRITE = 23
"""Linux 5.14+: fault every page of a range in for writing (Python's ``mmap`` names it from 3.13 on only)."""
PRUNE_INTERVAL_S = 0.5
"""How often the mappings of deleted files are let go (a deleted file's pages are freed only then)."""
BACKGROUND_RANGE_BYTES = 64 << 20
"""A blank file is populated this much at a time (~20 ms on an H200 host's tmpfs), then the populating
checks whether a save is writing."""
BACKGROUND_WAIT_S = 60.0
"""The longest the populating waits for saves before a range (a file attached by a requester that
never detaches it must not stop it for good)."""


class Server:
    """Serves the requests of one training process on ``sock`` with a pool of ``threads`` writers; ``keep``:
    written files' mappings are kept for the next write into them (:class:`KeptFile`)."""

    def __init__(self, sock: socket.socket, threads: int, slice_bytes: int, keep: bool = True) -> None:
        self.sock = sock
        self.pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="persist")
        self.slice = max(4096, slice_bytes)
        self.slabs: dict[int, Slab] = {}
        self.send_lock = threading.Lock()
        self.writes: set[threading.Thread] = set()
        crc = _load("codecs/crc.py")
        self.crc32, self.crc32_combine = crc.crc32, crc.crc32_combine
        self.run_in_lanes = _load("storage/lanes.py").run_in_lanes
        fsinfo = _load("storage/fsinfo.py")
        self.writeback_starter = fsinfo.writeback_starter
        self.pwrite_all = fsinfo.pwrite_all
        self.keep = keep
        """Keep each written file's mapping (:class:`KeptFile`); else map it for its write only."""
        self.kept: dict[tuple[int, int], KeptFile] = {}
        """Kept mappings by ``(st_dev, st_ino)``, least recently written first; one being written is out."""
        self.kept_lock = threading.Lock()
        self.attached: dict[int, AttachedFile] = {}
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
                    self.slabs[slab_id] = Slab(fds[0], nbytes)
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
            elif kind in ("write", "scatter", "attach", "put", "keep", "crc", "encode"):
                handlers: dict[str, Callable[[tuple, Any], None]] = {
                    "write": self.write, "scatter": self.scatter, "attach": self.attach, "put": self.put,
                    "keep": self.keep_blank, "crc": self.crc, "encode": self.encode}
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
            self.attached[request_id] = AttachedFile(fd, put, written, kept)
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

    def crc(self, message: tuple, _fd: None) -> None:
        _kind, request_id, ranges = message[:3]

        def one(r: tuple[int, int, int]) -> int:
            slab = self.slabs.get(r[0])
            if slab is None:
                raise ValueError(f"slab {r[0]} is not mapped")
            return int(self.crc32(slab.view[r[1]:r[1] + r[2]]))

        self._answer(request_id, None, lambda: list(self.pool.map(one, ranges)))

    def encode(self, message: tuple, fd: int) -> None:
        _kind, request_id, codec, level, chunk_bytes, mode, pieces = message[:7]
        self._answer(request_id, fd, lambda: self._encode(fd, codec, level, chunk_bytes, mode, pieces))

    def _encode(self, fd: int, codec: str, level: int, chunk_bytes: int, mode: str, pieces: list) -> list[int]:
        """Encode the native file ``pieces`` with ``codec`` into ``fd`` (:func:`checkpointd.storage.persist_codecs.encode_file`):
        through a kept mapping sized to the encoded file's bound in ``mmap`` mode, then cut to its end."""
        check_writable(fd)
        self._count_saving(1)
        try:
            if mode != "mmap":
                out = _codecs.FileSink(fd, self.crc32, self.pwrite_all)
                native = _codecs.encode_file(codec, level, chunk_bytes, pieces, self.slabs, self.pool, out)
            else:
                capacity = _codecs.encoded_bound(pieces, chunk_bytes)
                os.posix_fallocate(fd, 0, capacity)  # (a full disk: ENOSPC here, never SIGBUS in a copy)
                kept = self._checkout(fd, capacity)
                out = _codecs.MappedSink(kept.base, capacity, self.pool, self.crc32, self.crc32_combine)
                try:
                    native = _codecs.encode_file(codec, level, chunk_bytes, pieces, self.slabs, self.pool, out)
                finally:
                    try:
                        out.finish()  # (again after a failure: no copy may still run when the mapping goes)
                    finally:
                        self._checkin(kept)
            os.ftruncate(fd, out.offset)
            return [out.offset, out.crc, native]
        finally:
            self._count_saving(-1)

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
              ) -> tuple[Callable[[Slab, int, int, int], None], Callable[[int, int], None] | None, KeptFile | None]:
        """How to put bytes into ``fd`` (``put(slab, start, n, offset)``), its writeback starter and the
        mapping checked out for it (``mmap`` mode; the caller checks it in when done)."""
        check_writable(fd)
        kept = None
        if mode == "mmap" and end > 0:
            # Reserved first, so a full disk is ENOSPC here and never SIGBUS in a copy. (Reserving each
            # range with MADV_POPULATE_WRITE from the lanes instead is 3x slower on an H200 host's tmpfs.)
            os.posix_fallocate(fd, 0, end)
            kept = self._checkout(fd, end)
        if kept is not None:
            base = kept.base

            def put(slab: Slab, start: int, n: int, offset: int) -> None:
                ctypes.memmove(base + offset, slab.address + start, n)  # ctypes calls drop the GIL
        else:
            def put(slab: Slab, start: int, n: int, offset: int) -> None:
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

    def populate_in_background(self, entry: KeptFile) -> None:
        """Fault a blank file's pages into its kept mapping (``MADV_POPULATE_WRITE``) range by range,
        waiting while a save writes.

        Why ranges and waits: one advice over a whole blank file (3.2 GB: 1.2-1.6 s on an H200 host's
        tmpfs, one thread at this process's priority) holds up a save that comes meanwhile: its first
        file is answered only once the advice ends, and its writes beside the advice run at a third to
        a fifth of their rate; the first save of a host-budget run then stalls training 0.83-1.32 s
        against 0.25-0.29 s for the next ones, and 0.41-0.49 s with the waits. Between ranges the
        memory-map lock is free and nothing here competes with the save. A kernel without the advice leaves the faults to the
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

    def _checkout(self, fd: int, end: int) -> KeptFile:
        """The kept mapping of ``fd``'s file if it covers ``end`` bytes, else a new one; out of the table
        while it is written."""
        st = os.fstat(fd)
        with self.kept_lock:
            entry = self.kept.pop((st.st_dev, st.st_ino), None)
        if entry is not None and (entry.nbytes < end or not same_file(entry.fd, st)):
            entry.close()  # too small, or another file under a reused inode number: never written into
            entry = None
        return entry if entry is not None else KeptFile(fd, end)

    def _checkin(self, entry: KeptFile) -> None:
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
            replaced = self.kept.pop((st.st_dev, st.st_ino), None)
            if replaced is not None:
                evicted.append(replaced)
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

    def _task(self, task: list, put: Callable[[Slab, int, int, int], None],
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
