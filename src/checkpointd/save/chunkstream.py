"""Host staging within a memory budget: stream tensor bytes through a ring of fixed (pinned) chunks.

Why: the default snapshot copies the whole state into one pinned host buffer, so host memory equals
the state (per pending save). With ``host_staging_budget_bytes`` the host holds at most that much:
a :class:`ChunkRing` of equal chunks, allocated (and page-locked) once, ahead of time, and reused by
every save. The background writer streams the state through it, in file order:

    producer (committer thread)                 consumers (file threads)
    take a free chunk -> copy the next pieces   wait for the chunk's copy -> have its pieces written
    into it (side stream, after the save point) at their precomputed offsets (by the persist process,
    -> hand it to the file it belongs to        else the I/O pool), or into the streaming
                                                serializer/codec; CRC -> free the chunk

Large tensors are split across chunks; small ones share a chunk (one file per chunk). Consistency
(the save holds exactly the values at ``maybe_save``) now depends on training not touching a tensor
before its bytes have left the device, and the device bytes leave only as fast as chunks are freed
by the writes. So the training thread's hooks wait on the *host* (the measured stall): a registered
module's forward until the module buffers are copied (they go first, see ``savejob.buffers_first``),
an optimizer step until every piece is copied. Up to a budget's worth of bytes may still sit in
chunks waiting to be written when training resumes; they are host copies, so that is safe.

The copy itself is a parameter (:class:`CudaCopier`: side stream + events; :class:`CpuCopier`: plain
copies), so the ring, the planning, the waits and the writers run on CPU-only machines in tests.

Deadlock freedom: the producer takes chunks in one global order (early buffer chunks, then file by
file, record by record), and a streaming file consumes its records in the same order; buffers taken
early are capped at half the ring, so the producer can always make progress on the file being written.
A file cannot be retried after a failure (its bytes left the chunks); the save fails, the next one
starts afresh.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from checkpointd.format.streams import byte_view as memoryview_of

logger = logging.getLogger("checkpointd")

SPIN_WAIT_ENV = "CHECKPOINTD_SPIN_WAIT"


def host_waited_event() -> Any:
    """A CUDA event for a copy that a host thread may wait for, made with blocking synchronisation.

    Why: ``Event.synchronize`` on a default event spins a core until the GPU reaches it, and the
    writer's thread waits that way for every snapshot's device-to-host copy, for as long as the copy
    runs (8 ms at 0.45 GB, 44-88 ms at 2.4-4.8 GB). On an H200 host the committer thread used 10.7-12.6
    ms of CPU per 0.45 GB save, 4.1-6.6 with blocking events (session 12), while the training thread
    of a launch-bound loop was issuing kernels beside it. A blocking event puts the waiter to sleep
    until the GPU signals it, at the price of a wake-up. Under a host budget the training thread's
    hooks wait on these events too (``tests/gpu/test_host_budget_cuda.py`` ran with them).
    ``CHECKPOINTD_SPIN_WAIT=1`` keeps spinning (for comparisons).
    """
    return torch.cuda.Event(blocking=os.environ.get(SPIN_WAIT_ENV, "0") != "1")

MIN_CHUNK_BYTES = 1 << 20
"""Smallest chunk: below this, per-copy and per-write overheads dominate."""
MAX_CHUNK_BYTES = 64 << 20
"""Largest chunk: ~3 ms of PCIe copy; big enough to amortise overheads, small enough to overlap."""
MIN_CHUNKS = 4
"""Chunks the budget is cut into at least (when it allows MIN_CHUNK_BYTES each): copy, write and the
next copies overlap."""
PART_ALIGN = 64
"""Pieces start at this alignment inside a chunk (split records stay element-aligned for codecs)."""


def ring_geometry(budget_bytes: int) -> tuple[int, int]:
    """``(chunk_bytes, n_chunks)`` for a budget: at least two chunks of at least MIN_CHUNK_BYTES.

    ``n_chunks * chunk_bytes <= budget_bytes`` except for budgets under two minimal chunks, which are
    raised to that floor (the caller logs it).
    """
    chunk = (budget_bytes // MIN_CHUNKS) // 4096 * 4096
    chunk = min(MAX_CHUNK_BYTES, max(MIN_CHUNK_BYTES, chunk))
    return chunk, max(2, budget_bytes // chunk)


class ChunkStreamAborted(RuntimeError):
    """A file's bytes could not be streamed because the save failed elsewhere (see ``__cause__``)."""


class ChunkRing:
    """The fixed pool of host chunks: one allocation, page-locked when ``pin``, reused forever.

    In shared memory where the persist process runs (``shared`` None; see :mod:`checkpointd.storage.sharedmem`),
    so that process writes each chunk into its file (:meth:`FileRecords.fill`): the chunks are freed
    at the rate of the default path's writes (12-15 GB/s over retired tmpfs files on an H200 host)
    instead of in-process ``pwrite``'s (3-5 GB/s: one inode lock a file, and the ring holds one file at
    a time; ``benchmarks/RESULTS.md``, session 21, s21i), and under a budget that rate is the stall.
    """

    def __init__(self, chunk_bytes: int, n_chunks: int, pin: bool, shared: bool | None = None) -> None:
        from checkpointd.storage import sharedmem
        from checkpointd.save.snapshot import StagingArena  # one way to allocate and pin host memory

        self.chunk_bytes = chunk_bytes
        self.n_chunks = n_chunks
        self._arena = StagingArena([((chunk_bytes,), (1,), torch.uint8)] * n_chunks, pin=pin, shared=shared)
        self.nbytes = self._arena.nbytes
        self.pinned = self._arena.pinned
        self.buffers: list[torch.Tensor] = list(self._arena.buffers)
        located = [sharedmem.locate(memoryview_of(b)) for b in self.buffers]
        self.slots: list[tuple[Any, int]] | None = located if all(x is not None for x in located) else None  # type: ignore[assignment]
        """``(shared slab, offset)`` of each chunk, or None where the ring is in private memory."""
        self._cv = threading.Condition()
        self._free = list(range(n_chunks))[::-1]

    def acquire(self, stop: Callable[[], BaseException | None]) -> int:
        """A free chunk's index; blocks until one is released. Raises ``stop()``'s error if set."""
        with self._cv:
            while True:
                err = stop()
                if err is not None:
                    raise ChunkStreamAborted("host staging stream aborted") from err
                if self._free:
                    return self._free.pop()
                self._cv.wait()

    def release(self, index: int) -> None:
        with self._cv:
            self._free.append(index)
            self._cv.notify_all()

    def wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def reset(self) -> None:
        """Every chunk free again (between saves, once nothing reads or writes them)."""
        with self._cv:
            self._free = list(range(self.n_chunks))[::-1]
            self._cv.notify_all()

    def close(self) -> None:
        self._arena.release()
        self.buffers = []


# -- copiers ----------------------------------------------------------------------------------------------


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """1-D uint8 view of the bytes a staging buffer of ``t`` holds (its dense span; else contiguous)."""
    from checkpointd.save.snapshot import _is_dense, _span_elems

    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    if not _is_dense(t):
        t = t.contiguous()
    span = _span_elems(t.shape, t.stride())
    return torch.as_strided(t, (span,), (1,)).view(torch.uint8)


class CpuCopier:
    """Plain synchronous copies (CPU tensors; the ring logic in tests)."""

    def __init__(self) -> None:
        self._views: dict[int, torch.Tensor] = {}

    def copy(self, parts: Sequence["Part"], sources: Sequence[torch.Tensor], buf: torch.Tensor) -> Any:
        with torch.no_grad():
            for p in parts:
                src = self._view(p.src, sources)
                buf[p.chunk_offset:p.chunk_offset + p.length].copy_(src[p.start:p.start + p.length])
        return None

    def _view(self, i: int, sources: Sequence[torch.Tensor]) -> torch.Tensor:
        v = self._views.get(i)
        if v is None:
            v = self._views[i] = byte_view(sources[i])
        return v

    def fetch(self, src: torch.Tensor) -> torch.Tensor:
        return src.detach().clone()

    def wait_host(self, handle: Any) -> None:
        pass

    def order_compute_after(self, handle: Any) -> None:
        pass

    def close(self) -> None:
        self._views.clear()


class CudaCopier(CpuCopier):
    """Device-to-host copies on the side stream, ordered after the save point; one event per chunk."""

    def __init__(self, stream: Any, save_point: Any, device: torch.device,
                 before: Callable[[], None] | None = None) -> None:
        """``before``: queues what the first copy must follow on the same stream (device staging's clone)."""
        super().__init__()
        self.stream = stream
        self.save_point = save_point
        self.device = device
        self._before = before
        self._started = False

    def _begin(self) -> None:
        if not self._started:
            if self._before is not None:
                self._before()
            self.stream.wait_event(self.save_point)
            self._started = True

    def copy(self, parts: Sequence["Part"], sources: Sequence[torch.Tensor], buf: torch.Tensor) -> Any:
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream), torch.no_grad():
            self._begin()
            for p in parts:
                src = self._view(p.src, sources)  # non-dense sources: a contiguous copy on this stream
                buf[p.chunk_offset:p.chunk_offset + p.length].copy_(src[p.start:p.start + p.length], non_blocking=True)
            event = host_waited_event()
            event.record(self.stream)
        return event

    def fetch(self, src: torch.Tensor) -> torch.Tensor:
        """A small tensor's value now (GradScaler scale): synchronous copy on the side stream."""
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream), torch.no_grad():
            self._begin()
            out = src.detach().to("cpu")
        return out

    def wait_host(self, handle: Any) -> None:
        if handle is not None:
            handle.synchronize()

    def order_compute_after(self, handle: Any) -> None:
        if handle is not None:
            torch.cuda.current_stream(self.device).wait_event(handle)

    def close(self) -> None:
        if self._started:
            self.stream.synchronize()
        super().close()


# -- planning ---------------------------------------------------------------------------------------------


@dataclass
class Part:
    """Bytes ``[start, start + length)`` of source ``src`` (record ``key`` of file ``file``) in a chunk."""

    file: int
    key: str
    src: int
    start: int
    length: int
    chunk_offset: int
    chunk: "ChunkPlan | None" = None


@dataclass
class ChunkPlan:
    """One chunk's worth of parts (one file), and its state while the save streams."""

    file: int
    parts: list[Part] = field(default_factory=list)
    slot: int | None = None
    handle: Any = None
    arrived: bool = False
    remaining: int = 0
    copied: bool = False


Record = tuple[str, int, int]
"""``(record key, source index, nbytes)`` in the order the file holds its records."""


def plan_chunks(files: Sequence[Sequence[Record]], early: set[int], chunk_bytes: int,
                n_chunks: int) -> tuple[list[ChunkPlan], bool]:
    """Chunks in production order, and whether the ``early`` sources (module buffers) go first.

    Early records are packed first when they need at most half the ring; otherwise everything goes in
    file order (the forward pass then waits until the buffers come up naturally).
    """
    def pack(items: list[tuple[int, Record]]) -> list[ChunkPlan]:
        out: list[ChunkPlan] = []
        cur: ChunkPlan | None = None
        fill = 0
        for fi, (key, src, nbytes) in items:
            start = 0
            while start < nbytes:
                fill = (fill + PART_ALIGN - 1) // PART_ALIGN * PART_ALIGN
                if cur is None or cur.file != fi or fill >= chunk_bytes:
                    cur, fill = ChunkPlan(file=fi), 0
                    out.append(cur)
                n = min(nbytes - start, chunk_bytes - fill)
                part = Part(file=fi, key=key, src=src, start=start, length=n, chunk_offset=fill, chunk=cur)
                cur.parts.append(part)
                fill += n
                start += n
        return out

    items = [(fi, rec) for fi, recs in enumerate(files) for rec in recs]
    if early:
        first = pack([it for it in items if it[1][1] in early])
        if first and len(first) <= n_chunks // 2:
            return first + pack([it for it in items if it[1][1] not in early]), True
    return pack(items), False


# -- the stream of one save -------------------------------------------------------------------------------


class ChunkStream:
    """The staged copies of one save under a host budget: created by the snapshot, run by the writer.

    Life cycle: ``Snapshotter.snapshot`` creates it (training thread); the job's ``before_write``
    calls :meth:`fetch` for scalars it needs now and :meth:`plan` with every file's records (committer
    thread); ``write_files`` runs :meth:`produce` on the committer thread while the file threads
    consume through :class:`FileRecords`; :meth:`close` (after every file) frees the ring. Training
    hooks call :meth:`wait_copied`.
    """

    def __init__(self, ring: ChunkRing, copier: CpuCopier, sources: list[torch.Tensor], n_early: int,
                 clone: Any = None) -> None:
        self.ring = ring
        self.copier = copier
        self.sources = sources
        self.n_early = n_early
        self.clone = clone
        """Device staging: the ``snapshot.DeviceClone`` the sources are (training waits for it instead)."""
        self.error: BaseException | None = None
        self.buffers_issued = threading.Event()
        self.all_issued = threading.Event()
        self._buffers_handle: Any = None
        self._last_handle: Any = None
        self._cv = threading.Condition()
        self._chunks: list[ChunkPlan] = []
        self._files: list[FileRecords] = []
        self._closed = False
        self.waited_buffers = False
        if n_early == 0:
            self.buffers_issued.set()

    @property
    def private_source(self) -> bool:
        """The sources are a private device-staging copy: training never has to wait for them."""
        return self.clone is not None

    # -- committer thread -------------------------------------------------------------------------
    def fetch(self, index: int) -> torch.Tensor:
        """The value of source ``index`` on the host now (a small tensor needed before pickling)."""
        return self.copier.fetch(self.sources[index])

    def plan(self, files: Sequence[Sequence[Record]]) -> list["FileRecords"]:
        """Lay out the chunks for ``files`` (records in file order); returns one reader per file."""
        chunks, early_first = plan_chunks(files, set(range(self.n_early)), self.ring.chunk_bytes, self.ring.n_chunks)
        self._chunks = chunks
        for c in chunks:
            c.remaining = len(c.parts)
        last_early = max((i for i, c in enumerate(chunks) if any(p.src < self.n_early for p in c.parts)), default=-1)
        self._last_early = last_early
        if last_early < 0:
            self.buffers_issued.set()
        self._files = [FileRecords(self, i, [c for c in chunks if c.file == i]) for i in range(len(files))]
        if not early_first and self.n_early:
            logger.debug("checkpointd: module buffers exceed half the host staging ring; copied in file order")
        return self._files

    def produce(self) -> None:
        """Copy every chunk's pieces as chunks free up (committer thread). Raises on its own failure."""
        try:
            for i, c in enumerate(self._chunks):
                slot = self.ring.acquire(lambda: self.error)
                c.slot = slot
                c.handle = self.copier.copy(c.parts, self.sources, self.ring.buffers[slot])
                with self._cv:
                    c.arrived = True
                    self._cv.notify_all()
                self._last_handle = c.handle
                if i == self._last_early:
                    self._buffers_handle = c.handle
                    self.buffers_issued.set()
        except ChunkStreamAborted:
            pass  # someone else failed; they report it
        except BaseException as exc:
            self.abort(exc)
            raise
        finally:
            self.buffers_issued.set()
            self.all_issued.set()

    def abort(self, exc: BaseException) -> None:
        """Fail the stream: wake the producer, the consumers and the training thread's hooks."""
        with self._cv:
            if self.error is None:
                self.error = exc
            self._cv.notify_all()
        self.ring.wake()
        self.buffers_issued.set()
        self.all_issued.set()

    def close(self) -> None:
        """After every file is written (or failed): wait for copies in flight, free the ring."""
        if self._closed:
            return
        self._closed = True
        if not self.all_issued.is_set():
            self.abort(ChunkStreamAborted("the save ended before its bytes were copied"))
        try:
            self.copier.close()
        finally:
            self.ring.reset()
            self.buffers_issued.set()
            self.all_issued.set()
            self.sources = []

    # -- consumers -----------------------------------------------------------------------------------
    def _await(self, c: ChunkPlan) -> None:
        with self._cv:
            while not c.arrived:
                if self.error is not None:
                    raise ChunkStreamAborted("host staging stream aborted") from self.error
                self._cv.wait()
        if not c.copied:
            self.copier.wait_host(c.handle)
            c.copied = True

    def _consumed(self, c: ChunkPlan, nparts: int, barrier: Callable[[], None] | None = None) -> None:
        with self._cv:
            c.remaining -= nparts
            done = c.remaining == 0
        if done and c.slot is not None:
            try:
                if barrier is not None:
                    barrier()
            finally:
                self.ring.release(c.slot)

    def chunk_view(self, part: Part) -> memoryview:
        assert part.chunk is not None and part.chunk.slot is not None
        buf = self.ring.buffers[part.chunk.slot]
        return memoryview_of(buf)[part.chunk_offset:part.chunk_offset + part.length]

    # -- training thread ---------------------------------------------------------------------------
    def wait_copied(self, all_copies: bool) -> None:
        """Block until the module buffers (or everything) left the device; the compute stream then waits
        on the device for the last of those copies (a no-op for finished ones)."""
        flag, which = (self.all_issued, "_last_handle") if all_copies else (self.buffers_issued, "_buffers_handle")
        flag.wait()
        if self.error is None:
            self.copier.order_compute_after(getattr(self, which))

    def wait_host(self) -> None:
        """Block until every copy landed in host memory (``wait_for_snapshot``)."""
        self.all_issued.wait()
        if self.error is None and not self._closed:
            self.copier.wait_host(self._last_handle)

    def enqueue(self, max_bytes: int | None = None) -> None:
        """Nothing to queue: the writer issues the copies as chunks free up (``Snapshotter.flush``)."""


class FileRecords:
    """One file's view of the stream: its records' bytes, single use (a file cannot be retried)."""

    def __init__(self, stream: ChunkStream, index: int, chunks: list[ChunkPlan]) -> None:
        self._stream = stream
        self.index = index
        self._chunks = chunks
        self._by_key: dict[str, list[Part]] = {}
        for c in chunks:
            for p in c.parts:
                self._by_key.setdefault(p.key, []).append(p)
        self._used_keys: set[str] = set()
        self._filled = False
        self.barrier: Callable[[], None] | None = None
        """Called before a chunk is reused: a codec that still reads written buffers drains here."""

    def _once(self, what: str) -> None:
        raise RuntimeError(
            f"host staging budget: the bytes of {what} were already streamed through the chunk ring and "
            "are gone; a file cannot be written twice (the save fails, the next save starts afresh)"
        )

    def views(self, key: str) -> Iterator[memoryview]:
        """The bytes of record ``key`` in order, as views into chunks (streaming writers).

        Each view stays valid until the next one is asked for; the chunk is freed once its last part
        was passed on (after :attr:`barrier`).
        """
        if key in self._used_keys or self._filled:
            self._once(f"record {key!r}")
        self._used_keys.add(key)
        stream = self._stream
        for part in self._by_key.get(key, []):
            c = part.chunk
            assert c is not None
            stream._await(c)
            passed_on = False
            try:
                yield stream.chunk_view(part)
                passed_on = True
            finally:  # on failure, no barrier: the file is discarded and the ring reset after the save
                stream._consumed(c, 1, self.barrier if passed_on else None)

    def fill(self, pieces: dict[str, Any], put: Callable[[Any, int], None],
             written: Callable[[int, int], None] | None = None, remote: Any = None) -> list[tuple[Any, int, int, int]]:
        """Write every chunk of this file at its records' offsets (positional writers).

        Args:
            pieces: record key -> ``ptlayout.Piece`` (``offset`` is where the record starts in the file).
            put: ``put(view, file_offset)`` writes bytes (thread-safe).
            written: ``written(file_offset, nbytes)`` after each part of a chunk is put (early writeback).
            remote: the file attached to the persist process (``persist_process.RemoteFile``). Where the
                ring is in shared memory, that process writes each chunk (and starts its writeback)
                and the chunk is freed when it answers; a chunk it cannot take is written here.

        Returns:
            ``(piece, start, stop, crc)`` for every written range, for the caller to combine.
        """
        if self._filled or self._used_keys:
            self._once(f"file #{self.index}")
        self._filled = True
        use_remote = remote if self._stream.ring.slots is not None else None
        return _FileFill(self._stream, pieces, put, written, use_remote).run(self._chunks)


REMOTE_TASK_BYTES = 8 << 20
"""Bytes per task of a chunk handed to the persist process: a 64 MiB chunk is written by up to 8 of its
threads at once."""


class _FileFill:
    """One positional file's chunks, each written once it holds its bytes: by the persist process
    (``remote``) or on this process's I/O pool; a chunk's slot is freed once its bytes are in the file."""

    def __init__(self, stream: ChunkStream, pieces: dict[str, Any], put: Callable[[Any, int], None],
                 written: Callable[[int, int], None] | None, remote: Any) -> None:
        self.stream = stream
        self.pieces = pieces
        self.put = put
        self.written = written
        self.remote = remote
        self._cv = threading.Condition()
        self._pending = 0
        """Chunks handed to the process and not yet answered (or handed on to the pool after a failure)."""
        self._results: list[tuple[Any, int, int, int]] = []
        self._local: list[Any] = []
        """Futures of chunks written on the I/O pool."""
        self._errors: list[BaseException] = []
        self._warned = False

    def run(self, chunks: list[ChunkPlan]) -> list[tuple[Any, int, int, int]]:
        from checkpointd.storage.ptlayout import io_executor

        stream = self.stream
        pool = io_executor()
        first_error: BaseException | None = None
        try:
            for c in chunks:
                with stream._cv:  # hand a chunk on only once it holds data: pool threads never idle-wait
                    while not c.arrived and stream.error is None:
                        stream._cv.wait()
                if not c.arrived:
                    raise ChunkStreamAborted("host staging stream aborted") from stream.error
                if self.remote is not None and self._send(c):
                    continue
                future = pool.submit(self._write_here, c)
                with self._cv:
                    self._local.append(future)
        except BaseException as exc:  # noqa: BLE001 - wait for what was handed on first
            first_error = exc
        with self._cv:
            while self._pending:
                self._cv.wait()
            local = list(self._local)
        for f in local:
            try:
                self._results.extend(f.result())
            except BaseException as exc:  # noqa: BLE001
                first_error = first_error or exc
        first_error = first_error or (self._errors[0] if self._errors else None)
        if first_error is not None:
            raise first_error
        return self._results

    # -- here ------------------------------------------------------------------------------------------
    def _write_here(self, c: ChunkPlan) -> list[tuple[Any, int, int, int]]:
        from checkpointd.storage.ptlayout import _put_task  # the in-process writers' slice-by-slice CRC and put

        stream = self.stream
        try:
            stream._await(c)
            pieces = [self.pieces[part.key] for part in c.parts]
            crcs = _put_task(self.put, [(piece.offset + part.start, stream.chunk_view(part))
                                        for piece, part in zip(pieces, c.parts)], self.written)
            out = [(piece, part.start, part.start + part.length, crc) for piece, part, crc in zip(pieces, c.parts, crcs)]
        except BaseException as exc:
            stream.abort(exc)
            raise
        finally:
            if c.arrived:
                stream._consumed(c, len(c.parts))
        return out

    # -- in the persist process -----------------------------------------------------------------------
    def _tasks(self, c: ChunkPlan) -> tuple[list[list[tuple[int, Any, int, int]]], list[list[tuple[Any, int, int]]]]:
        """The process's tasks for chunk ``c`` (ranges of its slab, about :data:`REMOTE_TASK_BYTES` a
        task), and the ``(piece, start, stop)`` each range is."""
        assert self.stream.ring.slots is not None and c.slot is not None
        slab, base = self.stream.ring.slots[c.slot]
        tasks: list[list[tuple[int, Any, int, int]]] = []
        ranges: list[list[tuple[Any, int, int]]] = []
        filled = REMOTE_TASK_BYTES
        for part in c.parts:
            piece = self.pieces[part.key]
            for pos in range(0, part.length, REMOTE_TASK_BYTES):
                n = min(REMOTE_TASK_BYTES, part.length - pos)
                if filled + n > REMOTE_TASK_BYTES:
                    tasks.append([])
                    ranges.append([])
                    filled = 0
                tasks[-1].append((piece.offset + part.start + pos, slab, base + part.chunk_offset + pos, n))
                ranges[-1].append((piece, part.start + pos, part.start + pos + n))
                filled += n
        return tasks, ranges

    def _send(self, c: ChunkPlan) -> bool:
        """Hand chunk ``c`` to the process once its copy has landed; False where the process is gone."""
        from checkpointd.storage.persist_process import PersistProcessError

        self.stream._await(c)
        tasks, ranges = self._tasks(c)
        with self._cv:
            self._pending += 1
        try:
            future = self.remote.submit(tasks)
        except BaseException as exc:
            with self._cv:
                self._pending -= 1
                self._cv.notify_all()
            if isinstance(exc, PersistProcessError):
                self._fall_back(exc)
                return False
            raise
        future.add_done_callback(lambda f: self._answered(c, ranges, f))
        return True

    def _fall_back(self, exc: BaseException) -> None:
        self.remote = None
        if not self._warned:
            self._warned = True
            logger.warning("checkpointd: %s; writing the host staging chunks from this process", exc)

    def _answered(self, c: ChunkPlan, ranges: list[list[tuple[Any, int, int]]], future: Any) -> None:
        """The process's answer for chunk ``c`` (on its reply thread): keep the CRCs and free the slot;
        on the I/O pool instead if the process is gone; the save fails on a write error."""
        from checkpointd.storage.persist_process import PersistProcessError
        from checkpointd.storage.ptlayout import io_executor

        released = False
        try:
            exc = future.exception()
            if isinstance(exc, PersistProcessError):
                self._fall_back(exc)
                local = io_executor().submit(self._write_here, c)  # frees the slot when written
                released = True
                with self._cv:
                    self._local.append(local)
                return
            if exc is not None:
                raise exc
            out = [(piece, a, b, crc) for task, crcs in zip(ranges, future.result()) for (piece, a, b), crc in zip(task, crcs)]
            with self._cv:
                self._results.extend(out)
        except BaseException as err:  # noqa: BLE001 - the file thread raises it
            self.stream.abort(err)
            with self._cv:
                self._errors.append(err)
        finally:
            if not released:
                self.stream._consumed(c, len(c.parts))
            with self._cv:
                self._pending -= 1
                self._cv.notify_all()


__all__ = ["SPIN_WAIT_ENV", "ChunkRing", "ChunkStream", "ChunkStreamAborted", "CpuCopier", "CudaCopier", "FileRecords",
           "byte_view", "host_waited_event", "plan_chunks", "ring_geometry"]
