"""Host staging within a memory budget: stream tensor bytes through a ring of fixed (pinned) chunks.

The default snapshot copies the whole state into one pinned host buffer, so host memory equals the
state (per pending save). With ``StagingOptions.host_budget_bytes`` the host holds at most that much:
a :class:`~checkpointd.save.chunkring.ChunkRing` of equal chunks, allocated (and page-locked) once, ahead
of time, and reused by every save. The background writer streams the state through it, in file order:

    producer (committer thread)                 consumers (file threads)
    take a free chunk -> copy the next pieces   wait for the chunk's copy -> have its pieces written
    into it (side stream, after the save point) at their precomputed offsets (by the persist process,
    -> hand it to the file it belongs to        else the I/O pool, :mod:`~checkpointd.save.chunkfill`),
                                                or into the streaming serializer/codec; CRC -> free it

Large tensors are split across chunks; small ones share a chunk (one file per chunk). Consistency
(the save holds exactly the values at ``maybe_save``) depends on training not touching a tensor
before its bytes have left the device, and the device bytes leave only as fast as chunks are freed
by the writes. So the training thread's hooks wait on the *host* (the measured stall): a registered
module's forward until the module buffers are copied (they go first, see ``savejob.buffers_first``),
an optimizer step until every piece is copied. Up to a budget's worth of bytes may still sit in
chunks waiting to be written when training resumes; they are host copies, so that is safe.

The copy itself is a parameter (:mod:`~checkpointd.save.copiers`), so the ring, the planning, the waits
and the writers run on CPU-only machines in tests.

Deadlock freedom: the producer takes chunks in one global order (early buffer chunks, then file by
file, record by record), and a streaming file consumes its records in the same order; buffers taken
early are capped at half the ring, so the producer can always make progress on the file being written.
A file cannot be retried after a failure (its bytes left the chunks); the save fails, the next one
starts afresh.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from checkpointd.format.streams import byte_view as memoryview_of
from checkpointd.save.chunkfill import FileFill
from checkpointd.save.chunkring import PART_ALIGN, ChunkRing, ChunkStreamAborted
from checkpointd.save.copiers import CpuCopier

logger = logging.getLogger("checkpointd")


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

    Life cycle: ``Snapshotter.snapshot`` creates it (training thread); ``planning.wait_for_copies``
    calls :meth:`fetch` for scalars it needs now and ``planning.plan_stream`` calls :meth:`plan` with
    every file's records (committer thread); ``write_files`` runs :meth:`produce` on the committer
    thread while the file threads consume through :class:`FileRecords`; :meth:`close` (after every
    file, ``planning.release_staging``) frees the ring. Training hooks call :meth:`wait_copied`.
    """

    def __init__(self, ring: ChunkRing, copier: CpuCopier, sources: list[torch.Tensor], n_early: int,
                 clone: Any = None) -> None:
        self.ring = ring
        self.copier = copier
        self.sources = sources
        self.n_early = n_early
        self.clone = clone
        """Device staging: the ``device_copies.DeviceClone`` the sources are (training waits for it instead)."""
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
    def wait_arrived(self, c: ChunkPlan) -> bool:
        """Block until chunk ``c`` has its copy queued (True) or the stream failed (False)."""
        with self._cv:
            while not c.arrived and self.error is None:
                self._cv.wait()
            return c.arrived

    def await_copied(self, c: ChunkPlan) -> None:
        """Block until chunk ``c``'s bytes are in host memory; raises if the stream failed first."""
        with self._cv:
            while not c.arrived:
                if self.error is not None:
                    raise ChunkStreamAborted("host staging stream aborted") from self.error
                self._cv.wait()
        if not c.copied:
            self.copier.wait_host(c.handle)
            c.copied = True

    def consumed(self, c: ChunkPlan, nparts: int, barrier: Callable[[], None] | None = None) -> None:
        """``nparts`` of chunk ``c`` were passed on; the last one frees its slot (after ``barrier``)."""
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
        """The bytes of ``part`` in its chunk (valid until the chunk is freed)."""
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
            stream.await_copied(c)
            passed_on = False
            try:
                yield stream.chunk_view(part)
                passed_on = True
            finally:  # on failure, no barrier: the file is discarded and the ring reset after the save
                stream.consumed(c, 1, self.barrier if passed_on else None)

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
        return FileFill(self._stream, pieces, put, written, use_remote).run(self._chunks)
