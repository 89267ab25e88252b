"""The persist process, seen from the training process: start it, lend it slabs, have it write files.

Why a process: a training loop whose steps are launch-bound (small models, FSDP's Python hooks) feels
every millisecond that another thread of its process holds the GIL, and the fastest way to fill a
tmpfs file (a shared mapping written by many threads) takes page faults under the memory-map lock
that the training process's own allocations need. Measured on an H200 host (4.8 GB state, tmpfs):
16 threads filling mappings inside the training process persisted at 6.7 GB/s but cost the training
steps ~260 ms per checkpoint; 4 ``pwrite`` lanes per file cost ~1 ms but persisted at 4.1-4.7 GB/s.
The persist process (:mod:`checkpointd.storage.persist_process_main`) has its own GIL, its own address space
and a lower CPU priority, and reads the staged bytes where they are: staging arenas live in shared
memory (:mod:`checkpointd.storage.sharedmem`).

The writing goes there: the tensor records of a ``.pt``/``.mdlus`` written by positional writes
(:func:`checkpointd.storage.ptlayout.write_image`), read from the slabs, and at the end, in one request per
file, the zip headers and small members (a few hundred ``pwrite`` calls of a few bytes each, every one
of which would drop and retake the training process's GIL). Under a host staging budget the records
arrive chunk by chunk in a shared ring (:mod:`checkpointd.save.chunkstream`): the file is attached once
(:meth:`PersistProcess.attach`) and each chunk is one request (:meth:`RemoteFile.submit`), its slot
freed when the process answers. The layout, the headers' bytes, CRC
combination, fsync, manifest and commit stay in the training process. If the process cannot start, or dies,
the same bytes are written by the in-process threads instead (logged once): slower, never lost.

One process serves the whole training process (all managers); it starts with the first shared
staging arena and exits when its socket closes (the training process exited) or at interpreter exit.
It keeps its mapping of each file it filled through one, for the next save into that file
(:func:`keep_mappings`); those files' pages then count in its resident memory, though they are the
files' own (no extra memory but page tables).
:func:`checkpointd.options.persist_process_enabled` turns shared staging, and so this process, off.

Importing this module registers it with the layers below that must reach a running process: the
staging slabs (:func:`checkpointd.storage.sharedmem.on_release`: a released slab is unmapped there) and
the recycling bin (:func:`checkpointd.storage.recyclebin.ask_mapping_holder`: a retired file the process
keeps mapped is checked there).
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import socket
import subprocess
import sys
import threading
from concurrent.futures import Future
from typing import Any

from checkpointd.errors import CheckpointError
from checkpointd.storage import iopool
from checkpointd.storage import recyclebin
from checkpointd.storage import sharedmem
from checkpointd.storage import writemode
from checkpointd.storage.lanes import local_ranks
from checkpointd.storage.persist_protocol import receive_message, send_message

logger = logging.getLogger("checkpointd")

PERSIST_NICE = 10
"""The persist process's priority: ``0`` runs it like the training; otherwise it runs under
``SCHED_IDLE`` (only on cores nothing else wants), or at this nice increment where that policy is
refused. On an H200 host 16 threads writing one tmpfs file at nice 10 cost the training steps 0-2.5 ms
against 10-16 ms at nice 0; on 2x H200 (FSDP2, two persist processes of 32 threads on 32 cores, nice
10) the steps during the write still cost ~6 ms each."""

KEEP_MAPPINGS: bool | None = None
"""Whether the persist process keeps each file's mapping after writing it, for the next save into the
same (recycled) file (:class:`checkpointd.storage.persist_mappings.KeptFile`); None (the default): where
this host runs one rank (:func:`keep_mappings`)."""

_MAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "persist_process_main.py")


class PersistProcessError(CheckpointError):
    """The persist process is gone or could not do a write; the caller writes those bytes itself."""


class PersistProcess:
    """A running persist process and the socket to it (thread-safe)."""

    def __init__(self, threads: int, slice_bytes: int) -> None:
        self.threads = threads
        """The process's writing threads."""
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.keeps_mappings = keep_mappings()
        """Whether the process keeps each written file's mapping (:func:`keep_mappings`)."""
        args = [sys.executable, *(["-P"] if sys.version_info >= (3, 11) else []), _MAIN,
                str(child.fileno()), str(threads), str(PERSIST_NICE), str(slice_bytes), str(int(self.keeps_mappings))]
        try:
            self.proc = subprocess.Popen(args, pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL, close_fds=True)
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
        self.sock = parent
        self._send_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._pending: dict[int, Future[Any]] = {}
        self._queries: set[int] = set()
        """Pending requests that write nothing (``exclusive``): not counted in :attr:`writes_done`."""
        self._ids = itertools.count(1)
        self._mapped: set[int] = set()
        self.alive = True
        self.writes_done = 0
        """Write requests the process completed (tests, diagnostics)."""
        self._reader = threading.Thread(target=self._read_replies, name="checkpointd-persist-replies", daemon=True)
        self._reader.start()

    # -- requests ---------------------------------------------------------------------------------------

    def map_slab(self, slab: Any) -> None:
        """Lend ``slab`` (a :class:`checkpointd.storage.sharedmem.SharedSlab`) to the process, once."""
        with self._state_lock:
            if slab.id in self._mapped:
                return
            self._mapped.add(slab.id)
        self._send(("map", slab.id, slab.nbytes), [slab.fd])

    def unmap_slab(self, slab_id: int) -> None:
        with self._state_lock:
            if slab_id not in self._mapped:
                return
            self._mapped.discard(slab_id)
        try:
            self._send(("unmap", slab_id))
        except PersistProcessError:
            pass

    def submit_write(self, fd: int, end: int, mode: str, lanes: int, tasks: list[list[tuple[int, int, int, int]]],
                     slabs: list[Any], writeback: bool = False) -> Future[Any]:
        """Start writing ``tasks`` into the open file ``fd``; the future gives each task's range CRCs.

        ``writeback``: start the disk on each range once written (:func:`checkpointd.storage.fsinfo.early_writeback`).

        The process gets its own copy of ``fd``, so the caller may close it once the future is done.
        """
        for slab in slabs:
            self.map_slab(slab)
        return self._submit(("write", end, mode, lanes, tasks, writeback), fd)

    def attach(self, fd: int, end: int, mode: str, lanes: int, writeback: bool = False,
               timeout: float = 120.0) -> "RemoteFile":
        """Hold the open file ``fd`` in the process for a series of :meth:`RemoteFile.submit` writes, each
        run ``lanes`` tasks at a time (``mode``, ``writeback``: as :meth:`submit_write`'s).

        Why: under a host staging budget a file's bytes arrive chunk by chunk (:mod:`checkpointd.save.chunkstream`);
        a ``write`` request per chunk would reserve and map the file anew each time, while an attached
        file is reserved and mapped once (and finds its kept mapping, when recycled). Raises ``OSError``
        where the file cannot be reserved (a full disk), :class:`PersistProcessError` where the process is gone.
        """
        request_id, future = self._request(("attach", end, mode, writeback), fd)
        future.result(timeout=timeout)
        return RemoteFile(self, request_id, lanes)

    def keep_blank(self, fd: int, nbytes: int, timeout: float = 300.0) -> None:
        """Have the process reserve the open file ``fd`` to ``nbytes``, map it with its pages faulted in,
        and keep the mapping, so that the first write into it runs as fast as over a recycled file."""
        self._submit(("keep", nbytes), fd).result(timeout=timeout)

    def submit_scatter(self, fd: int, pieces: list[tuple[int, bytes]]) -> Future[Any]:
        """Start ``pwrite``-ing each ``(offset, bytes)`` of ``pieces`` into the open file ``fd``.

        Why: a file's zip headers and small members are a few hundred writes of tens of bytes. Made
        here, each would drop and retake the training process's GIL; the process makes them in one
        request. The caller may close ``fd`` once the future is done.
        """
        return self._submit(("scatter", pieces), fd)

    def submit_crc(self, ranges: list[tuple[Any, int, int]]) -> Future[Any]:
        """Start the CRC-32 of each ``(slab, slab_offset, length)`` of ``ranges`` in the process; the future
        gives them in order."""
        for slab in {slab.id: slab for slab, _, _ in ranges}.values():
            self.map_slab(slab)
        return self._request(("crc", [(slab.id, start, n) for slab, start, n in ranges]), None, writes=False)[1]

    def submit_encode(self, fd: int, codec: str, level: int, chunk_bytes: int, pieces: list[tuple],
                      slabs: list[Any]) -> Future[Any]:
        """Start writing the native file ``pieces`` into the open file ``fd``, encoded with ``codec``
        (the ``encode`` request of :mod:`checkpointd.storage.persist_protocol`); the future gives
        ``[size, CRC-32, native size]``. The caller may close ``fd`` once the future is done."""
        for slab in slabs:
            self.map_slab(slab)
        return self._submit(("encode", codec, level, chunk_bytes, writemode.persist_mode(fd)[0], pieces), fd)

    def exclusive(self, st: os.stat_result, timeout: float = 10.0) -> bool | None:
        """Whether the process keeps a mapping of the file ``st`` describes and that is its only open
        file (``None``: it keeps none; ask the file system instead).

        Why: the process keeps its mappings of written files for the next save into them
        (:class:`checkpointd.storage.persist_mappings.KeptFile`), so the file looks open to a lease taken
        here; the process takes it on its own descriptor (:meth:`checkpointd.storage.recycle.Retirement.retire`).
        """
        future = self._submit(("exclusive", st.st_dev, st.st_ino), None)
        result = future.result(timeout=timeout)
        return None if result is None else bool(result)

    def _submit(self, request: tuple, fd: int | None) -> Future[Any]:
        """Send ``request`` (its kind, then its arguments) with a new request id and ``fd`` (if any)."""
        return self._request(request, fd)[1]

    def _request(self, request: tuple, fd: int | None, writes: bool | None = None) -> tuple[int, Future[Any]]:
        """:meth:`_submit`, and the request's id. ``writes``: whether it counts in :attr:`writes_done`
        (default: requests that send a file)."""
        future: Future[Any] = Future()
        request_id = next(self._ids)
        with self._state_lock:
            if not self.alive:
                raise PersistProcessError("the persist process has exited")
            self._pending[request_id] = future
            if not (fd is not None if writes is None else writes):
                self._queries.add(request_id)
        try:
            self._send((request[0], request_id, *request[1:]), None if fd is None else [fd])
        except BaseException:
            with self._state_lock:
                self._pending.pop(request_id, None)
                self._queries.discard(request_id)
            raise
        return request_id, future

    def close(self) -> None:
        """Ask the process to exit and wait a little for it."""
        try:
            self._send(("exit",))
        except PersistProcessError:
            pass
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # pragma: no cover - a write stuck in the kernel
            self.proc.kill()
        self.sock.close()

    # -- plumbing ---------------------------------------------------------------------------------------

    def _send(self, message: tuple, fds: list[int] | None = None) -> None:
        with self._send_lock:
            if not self.alive:
                raise PersistProcessError("the persist process has exited")
            try:
                send_message(self.sock, message, fds)
            except OSError as exc:
                self._mark_dead(f"sending to it failed ({exc})")
                raise PersistProcessError(f"the persist process is unreachable: {exc}") from exc

    def _read_replies(self) -> None:
        try:
            while True:
                message, fds = receive_message(self.sock)
                for fd in fds:
                    os.close(fd)
                if message is None:
                    break
                with self._state_lock:
                    future = self._pending.pop(message[1], None)
                    query = message[1] in self._queries
                    self._queries.discard(message[1])
                if future is None:
                    continue
                if message[0] == "ok":
                    if not query:
                        self.writes_done += 1
                    future.set_result(message[2])
                elif message[0] == "oserror":
                    future.set_exception(OSError(message[2], f"persist process: {message[3]}"))
                else:
                    future.set_exception(PersistProcessError(f"persist process: {message[2]}"))
        except OSError:
            pass
        code = self.proc.poll()
        self._mark_dead("it exited" if code is None else f"it exited with code {code}")

    def _mark_dead(self, why: str) -> None:
        with self._state_lock:
            was_alive, self.alive = self.alive, False
            pending, self._pending = self._pending, {}
        for future in pending.values():
            future.set_exception(PersistProcessError(f"the persist process is gone: {why}"))
        if was_alive and not _closing:
            logger.warning("checkpointd: the persist process is gone (%s); files are written by in-process threads", why)


class RemoteFile:
    """A file attached to the persist process (:meth:`PersistProcess.attach`): write ranges of shared
    slabs into it, request by request, then :meth:`detach` once every request is answered."""

    def __init__(self, process: PersistProcess, file_id: int, lanes: int) -> None:
        self.process = process
        self.file_id = file_id
        self.lanes = lanes

    def submit(self, tasks: list[list[tuple[int, Any, int, int]]]) -> Future[Any]:
        """Write ``tasks`` (lists of ``(file_offset, slab, slab_offset, length)``), :attr:`lanes` at a
        time; the future gives each task's range CRCs, as :meth:`PersistProcess.submit_write`'s."""
        slabs = {slab.id: slab for task in tasks for _, slab, _, _ in task}
        for slab in slabs.values():
            self.process.map_slab(slab)
        ranges = [[(offset, slab.id, start, length) for offset, slab, start, length in task] for task in tasks]
        return self.process._request(("put", self.file_id, self.lanes, ranges), None, writes=True)[1]

    def detach(self, timeout: float = 30.0) -> None:
        """Let the process close the file (after every :meth:`submit` is answered). Never raises: a gone
        process holds nothing."""
        try:
            self.process._submit(("detach", self.file_id), None).result(timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - the file is closed here either way; nothing is lost
            logger.debug("checkpointd: detaching file %d from the persist process: %s", self.file_id, exc)


_lock = threading.Lock()
_client: PersistProcess | None = None
_start_failed = False
_closing = False


def client() -> PersistProcess | None:
    """The process-wide persist process, started on first use; None where it cannot run."""
    global _client, _start_failed
    current = _client
    if current is not None and current.alive:
        return current
    if _start_failed or not sharedmem.supported():
        return None
    with _lock:
        if _client is not None and _client.alive:
            return _client
        if _client is not None and _client.writes_done == 0:  # died without writing anything: it cannot run here
            _start_failed = True
            logger.warning("checkpointd: the persist process exited ahead of its first write; writing from in-process threads")
            return None
        try:
            _client = PersistProcess(threads_for(iopool.io_threads()), iopool.CRC_SLICE_BYTES)
        except Exception as exc:  # noqa: BLE001 - the in-process writer still works
            _start_failed = True
            logger.warning("checkpointd: could not start the persist process (%s); writing from in-process threads", exc)
            return None
        return _client


def keep_mappings() -> bool:
    """:data:`KEEP_MAPPINGS` if set, else whether this host runs one rank (``LOCAL_WORLD_SIZE``, or
    ``WORLD_SIZE`` without it).

    Why not where it runs several: rank 0's retention retires the other ranks' files too, and it can
    ask only its own process whether a file is in use; another rank's kept mapping would make every one
    of that rank's files look in use, and they would be deleted instead of recycled."""
    if KEEP_MAPPINGS is not None:
        return bool(KEEP_MAPPINGS)
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "") or 0)
        world = int(os.environ.get("WORLD_SIZE", "") or 1)
    except ValueError:
        return False
    return local == 1 if local > 0 else world <= 1


def threads_for(io_threads: int) -> int:
    """The persist process's writing threads: the I/O pool's size (``io_threads``) shared by the ranks
    of this host (``LOCAL_WORLD_SIZE``, set by ``torchrun``), at least 4. Read when the process starts.

    Every rank starts its own persist process; without the division two ranks on 32 cores would run
    64 writing threads.
    """
    return max(4, io_threads // local_ranks())


def forget_slab(slab_id: int) -> None:
    """Have the running persist process (if any) unmap the slab ``slab_id``."""
    current = _client
    if current is not None and current.alive:
        current.unmap_slab(slab_id)


def keep_blank_file(fd: int, nbytes: int) -> bool:
    """For :class:`checkpointd.storage.filesahead.FilesAhead`: have the persist process reserve the open file
    ``fd`` and keep it mapped (:meth:`PersistProcess.keep_blank`) where it will write that file through a
    kept mapping (a memory file system, one rank a host); False where it will not (the caller reserves it)."""
    if not sharedmem.supported() or writemode.persist_mode(fd)[0] != "mmap":
        return False
    process = client()
    if process is None or not process.keeps_mappings:
        return False
    try:
        process.keep_blank(fd, nbytes)
    except PersistProcessError:
        return False
    return True


def holds_only_open(st: os.stat_result) -> bool | None:
    """For retention's check that nothing else uses a retired file (:mod:`checkpointd.storage.recyclebin`): the
    running persist process's answer (:meth:`PersistProcess.exclusive`), ``None`` where none runs, it
    keeps no mapping of that file, or it does not answer."""
    current = _client
    if current is None or not current.alive:
        return None
    try:
        return current.exclusive(st)
    except Exception:  # noqa: BLE001 - gone, or too slow: the file system decides (and a kept mapping makes it refuse)
        return None


def shutdown() -> None:
    """Stop the persist process (at interpreter exit; tests)."""
    global _client, _closing
    with _lock:
        current, _client = _client, None
    if current is not None:
        _closing = True
        try:
            current.close()
        finally:
            _closing = False


def _forget_in_child() -> None:
    """A forked child (a DataLoader worker) must not talk to its parent's persist process."""
    global _client
    if _client is not None:
        try:
            _client.sock.close()
        except OSError:
            pass
    _client = None


atexit.register(shutdown)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
sharedmem.on_release(forget_slab)
recyclebin.ask_mapping_holder(holds_only_open)

__all__ = ["KEEP_MAPPINGS", "PERSIST_NICE", "PersistProcess", "PersistProcessError", "RemoteFile", "client",
           "forget_slab", "holds_only_open", "keep_blank_file", "keep_mappings", "shutdown", "threads_for"]
