"""The host budget's ring: a fixed pool of (pinned) host chunks that every save streams its bytes through.

:func:`ring_geometry` cuts ``StagingOptions.host_budget_bytes`` into equal chunks; a :class:`ChunkRing` is
their one allocation (a :class:`~checkpointd.save.arena.StagingArena`, page-locked on CUDA), made once
and reused by every save; :class:`RingKeeper` makes it ahead of the first save on a background thread
(allocating and page-locking take ~0.5 s/GiB). :mod:`checkpointd.save.chunkstream` plans and runs one
save's stream through it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from checkpointd.format.streams import byte_view as memoryview_of
from checkpointd.save.arena import StagingArena
from checkpointd.storage import sharedmem

logger = logging.getLogger("checkpointd")

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
    so that process writes each chunk into its file (``chunkstream.FileRecords.fill``): the chunks are
    freed at the rate of the default path's writes (12-15 GB/s over retired tmpfs files on an H200 host)
    instead of in-process ``pwrite``'s (3-5 GB/s: one inode lock a file, and the ring holds one file at
    a time), and under a budget that rate is the stall.
    """

    def __init__(self, chunk_bytes: int, n_chunks: int, pin: bool, shared: bool | None = None) -> None:
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


class RingKeeper:
    """The one :class:`ChunkRing` of a snapshotter with a host budget, made on a background thread.

    ``on_ready(ring)`` runs (under no lock) once the ring exists, on the thread that made it.
    """

    def __init__(self, budget_bytes: int, on_ready: Callable[[ChunkRing], None]) -> None:
        self.budget_bytes = budget_bytes
        self._on_ready = on_ready
        self._lock = threading.Lock()
        self.ring: ChunkRing | None = None
        self._thread: threading.Thread | None = None

    def start(self, pin: bool) -> None:
        """Make the ring (page-locked when ``pin``) in the background, unless it exists or is being made."""
        with self._lock:
            if self.ring is not None or self._thread is not None:
                return
            self._thread = threading.Thread(target=self._make, args=(pin,), name="checkpointd-ring", daemon=True)
        self._thread.start()

    def preparing(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive()

    def _make(self, pin: bool) -> None:
        chunk, n = ring_geometry(self.budget_bytes)
        if chunk * n > self.budget_bytes:
            logger.warning("checkpointd: StagingOptions.host_budget_bytes=%d is below the floor of %d chunks of %d bytes; "
                           "staging through %d bytes", self.budget_bytes, n, chunk, chunk * n)
        try:
            ring = ChunkRing(chunk, n, pin=pin)
        except Exception as exc:  # pragma: no cover - the save path retries synchronously
            logger.warning("checkpointd: allocating the host staging ring failed: %s", exc)
            return
        with self._lock:
            if self.ring is not None:
                ring.close()
                return
            self.ring = ring
        self._on_ready(ring)

    def get(self, pin: bool) -> ChunkRing:
        """The ring, waiting for (or, failing that, making) it on this thread."""
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        if self.ring is None:
            self._make(pin)
        if self.ring is None:
            raise RuntimeError("checkpointd: could not allocate the host staging ring")
        return self.ring

    def close(self) -> None:
        """Wait for a ring being made, then free it."""
        thread = self._thread
        if thread is not None:
            thread.join()
        with self._lock:
            ring, self.ring = self.ring, None
        if ring is not None:
            ring.close()
