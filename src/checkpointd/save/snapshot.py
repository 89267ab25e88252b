"""Snapshot: copy every registered tensor into reused CPU buffers, without stalling training on CUDA.

Why this shape:
- **Reused buffers.** A :class:`StagingArena` is one host allocation carved into one buffer per tensor,
  laid out with the source's strides (channels_last stays channels_last). It is reused by every save
  whose tensors have the same shapes, strides and dtypes, so steady-state saves allocate nothing.
  Each buffer owns exactly its bytes (a ``torch.frombuffer`` view), so the serializer writes no
  whole-slab bloat.
- **Pinned, exact size.** On CUDA the arena is page-locked with ``cudaHostRegister`` rather than
  ``pin_memory=True``: PyTorch's caching host allocator rounds every block up to a power of two, which
  would nearly double host memory for a 5 GB state. Registration costs ~0.5 s/GiB, so arenas are
  prepared ahead on a background thread (the manager starts it at the end of the first restore, the
  first ``maybe_save`` call or the first optimizer step, and again when optimizer state first exists),
  off the training thread's critical path. Its pages are allocated first (``MADV_POPULATE_WRITE``,
  :mod:`checkpointd.storage.pagemem`), then registered: registering fresh pages allocated them inside the
  driver call, and the training thread's CUDA calls waited for it (H200 host, 4.83 GB: one step of
  1.7-2.8 s; populated first, 0.15-0.37 s; ``benchmarks/RESULTS.md`` sessions 17-18). The pages are
  allocated on four threads, and the registration goes in pieces of 256 MiB with pauses between
  them, so no step waits for more than one piece (:meth:`StagingArena._register_pinned`). The whole
  preparation took 2.6 s for 4.83 GB (H100) and 8.9 s for 20 GB (H200): a first save sooner than that
  waits for the rest of it (the pauses are then skipped). That thread also does the first save's other one-time work:
  it pickles the new arena's buffers once (the manager's ``on_arena_ready``: the reduction cache is
  then warm) and, with device staging, launches the clone's kernel once (CUDA loads it lazily).
- **Device staging clones on the side stream too.** With ``device_staging_budget_bytes`` the live
  tensors are first cloned into a private GPU buffer (:class:`DeviceClone`), queued like the
  device-to-host copies (next point) and ordered after the save point on the side stream, so the clone (~10 ms for 20 GB at
  2 TB/s) runs under the next forward and backward instead of lengthening the save step; the compute
  stream waits for it (on the GPU) at the same two hooks, and the device-to-host copies that follow
  read the private copy, paced over the next steps.
- **Side stream, no host wait, overlapped with the next step.** ``maybe_save`` records an event on the
  compute stream (the save point) and returns. The device-to-host copies are queued on a side stream,
  ordered after that event, at the first moment something could modify a snapshotted tensor: the
  registered modules' next forward (pre-hook) or the registered optimizers' next step (pre-hook), or
  ``wait_for_snapshot``/the next save/``wait``. So they overlap the next forward and backward instead of
  lengthening the save step. Then the compute stream (not the host) waits on an event: the forward
  waits for the module buffers (copied first, e.g. BatchNorm running stats), the optimizer step for
  everything. Copies that are done cost nothing. If no hook fires for a while, the background writer
  queues them itself; ordering after the save-point event keeps them exact either way.
- **CPU-only torch.** Pinned memory, streams and events do not exist there: the arena is plain memory
  and the copy is synchronous inside ``maybe_save``, so any mutation afterwards is safe.
- **Host budget (opt-in).** With ``host_budget_bytes`` the CUDA tensors are not staged into an arena
  at all: the snapshot hands out placeholders (meta tensors of the same layout, so the files can be
  planned and pickled) and a :class:`~checkpointd.save.chunkstream.ChunkStream` that the writer runs
  through a fixed ring of pinned chunks (one allocation, made ahead, reused). The hooks then wait on
  the host until the bytes left the device. CPU-resident tensors are still copied in ``maybe_save``
  (into an unpinned reused arena). On CPU-only torch the budget is ignored (logged): CPU tensors
  may change right after ``maybe_save``, so they must be copied there.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from checkpointd.storage import pagemem
from checkpointd.storage import sharedmem
from checkpointd.save.chunkstream import ChunkStream, host_waited_event
from checkpointd.storage.lanes import local_ranks

logger = logging.getLogger("checkpointd")

ALIGN_BYTES = 64
POPULATE_STAGING_ENV = "CHECKPOINTD_POPULATE_STAGING"
"""``0``: page-lock a new arena's fresh pages as they are (the driver then allocates them inside
``cudaHostRegister``); default: allocate them first (:func:`checkpointd.storage.pagemem.populate_write`)."""
REGISTER_PIECE_ENV = "CHECKPOINTD_REGISTER_PIECE_MB"
"""Page-lock an arena in pieces of about this many MiB (``0``: in one call); see
:meth:`StagingArena._register_pinned`."""
REGISTER_PIECE_BYTES = 256 << 20
REGISTER_PAUSE_ENV = "CHECKPOINTD_REGISTER_PAUSE"
"""After each piece, pause this many times as long as the piece took (``0``: no pause)."""
REGISTER_PAUSE = 3.0
POPULATE_THREADS_ENV = "CHECKPOINTD_POPULATE_THREADS"
"""Threads allocating a new arena's pages (:func:`checkpointd.storage.pagemem.populate_write`); default
:data:`POPULATE_THREADS`, fewer where the host's cores are shared by more ranks (``LOCAL_WORLD_SIZE``)."""
POPULATE_THREADS = 4
PAGE_BYTES = 4096
DEVICE_PACE_BYTES = 512 << 20
"""Device staging: bytes of device-to-host copy queued per training-thread hook (two per step), so a
step's share of the copy runs under its own compute instead of delaying a later synchronisation."""
PLAN_DEFER_MIN_BYTES = 1 << 30
"""Snapshots of at least this many bytes defer the committer's planning to the training thread's next
optimizer step (``PendingCopies.training_waits``). Below it the step after the save has no long wait for
the GPU to plan in (the copy hides under forward and backward), and deferring cost the 0.45 GB
reference 2-4 ms a checkpoint, against 4-7 ms saved at 4.83 GB (H100 and H200, session 9)."""
TensorSpec = tuple[tuple[int, ...], tuple[int, ...], torch.dtype]
STREAM_CPU_TENSORS = False
"""Testing only: with a host budget, stream CPU tensors through the chunk ring too (plain copies, hooks
installed) so CPU-only tests exercise the budget path. Unsafe for real runs: on CPU anything may modify a
tensor right after ``maybe_save``, not only the hooked optimizer step and forward."""


def tensor_spec(t: torch.Tensor) -> TensorSpec:
    """(shape, staging strides, dtype): the staging strides keep a dense layout, else contiguous."""
    if _is_dense(t):
        stride = tuple(t.stride())
    else:
        stride = tuple(torch.empty(t.shape, dtype=t.dtype, device="meta").stride())
    return tuple(t.shape), stride, t.dtype


def _is_dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: any permutation of a contiguous layout (channels_last included)."""
    if t.is_contiguous() or t.is_contiguous(memory_format=torch.channels_last):
        return True
    if t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d):
        return True
    import torch._prims_common as prims

    check = getattr(prims, "is_non_overlapping_and_dense_or_false", None) or getattr(prims, "is_non_overlapping_and_dense", None)
    return bool(check(t)) if check is not None else False


def _span_elems(shape: Sequence[int], stride: Sequence[int]) -> int:
    if any(s == 0 for s in shape):
        return 0
    return 1 + sum((n - 1) * st for n, st in zip(shape, stride))


def _env_number(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected a number") from None
    if value < 0:
        raise ValueError(f"{name}={raw!r}: expected a number >= 0")
    return value


def register_piece_bytes() -> int:
    """Bytes per page-locking call (``CHECKPOINTD_REGISTER_PIECE_MB``; 0: the whole arena at once)."""
    return int(_env_number(REGISTER_PIECE_ENV, REGISTER_PIECE_BYTES / (1 << 20)) * (1 << 20))


def register_pause() -> float:
    return _env_number(REGISTER_PAUSE_ENV, REGISTER_PAUSE)


def populate_threads() -> int:
    """At most :data:`POPULATE_THREADS`, and no more than a quarter of this rank's share of the cores."""
    if os.environ.get(POPULATE_THREADS_ENV, "").strip():
        return max(1, int(_env_number(POPULATE_THREADS_ENV, POPULATE_THREADS)))
    return max(1, min(POPULATE_THREADS, (os.cpu_count() or 1) // (4 * local_ranks())))


def arena_layout(specs: Sequence[TensorSpec], piece_bytes: int) -> tuple[list[int], int, list[tuple[int, int]]]:
    """``(offsets, total, pieces)``: where each tensor's buffer starts in the arena, its size, and the
    byte ranges it is page-locked in.

    Buffers are packed at :data:`ALIGN_BYTES`. With ``piece_bytes`` > 0 they are grouped into pieces
    of at most that size (a larger buffer is a piece of its own): every piece starts on a page and no
    buffer crosses into the next one, because a device-to-host copy is asynchronous only into memory
    that one registration covers, and two registrations must not share a page.
    """
    offsets: list[int] = []
    pieces: list[tuple[int, int]] = []
    total = piece_start = 0
    for shape, stride, dtype in specs:
        nbytes = _span_elems(shape, stride) * dtype.itemsize
        padded = (nbytes + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES
        if piece_bytes > 0 and total > piece_start and total + padded - piece_start > piece_bytes:
            total = (total + PAGE_BYTES - 1) // PAGE_BYTES * PAGE_BYTES
            pieces.append((piece_start, total))
            piece_start = total
        offsets.append(total)
        total += padded
    if total > piece_start:
        pieces.append((piece_start, total))
    return offsets, total, pieces


def _private_slab(nbytes: int) -> torch.Tensor:
    """``nbytes`` of anonymous memory, page-aligned (``torch.empty`` aligns to 64 bytes only), released in
    pieces when the last view dies (:class:`checkpointd.storage.pagemem.PiecewiseReleasedMap`)."""
    import numpy as np

    return torch.from_numpy(np.frombuffer(pagemem.PiecewiseReleasedMap(-1, nbytes), dtype=np.uint8))


def _shared_slab(nbytes: int) -> "sharedmem.SharedSlab | None":
    """A shared slab lent to the persist process (started here, off the training thread), or None."""
    from checkpointd.storage import persist_process

    try:
        slab = sharedmem.SharedSlab(nbytes)
    except OSError as exc:
        logger.warning("checkpointd: could not allocate %d bytes of shared staging memory (%s); using private memory", nbytes, exc)
        return None
    process = persist_process.client()
    if process is not None:
        try:
            process.map_slab(slab)
        except persist_process.PersistProcessError:
            pass
    return slab


def _warm_device_clone(buffers: list[torch.Tensor]) -> None:
    """Launch the device-staging clone's kernel once, on one element per dtype, ahead of the first save.

    Why: CUDA loads a kernel's module at its first launch (lazy loading). The clone's
    ``torch._foreach_copy_`` then took 21.7 ms of host time (and 23.7 ms on the GPU) the first time
    against 0.6-0.7 ms afterwards (H200, 320 tensors, 4.83 GB), and the first save call paid for it
    (26 ms against 6). The kernel is chosen by dtype, not size, so a tiny copy loads it.
    """
    firsts: dict[torch.dtype, torch.Tensor] = {}
    for b in buffers:
        if b.numel() and b.dtype not in firsts:
            firsts[b.dtype] = b.as_strided((1,), (1,))
    if firsts:
        sources = list(firsts.values())
        with torch.no_grad():
            torch._foreach_copy_([torch.empty_like(x) for x in sources], sources)


class StagingArena:
    """One host allocation holding a buffer for each tensor of a given layout signature."""

    def __init__(self, specs: Sequence[TensorSpec], pin: bool, shared: bool | None = None,
                 hurry: threading.Event | None = None) -> None:
        """``shared``: in shared memory for the persist process (default: where it runs, see
        :mod:`checkpointd.storage.sharedmem`). ``hurry``: once set (a save is waiting for this arena), the
        pauses between the pieces it is page-locked in are skipped."""
        self.specs = tuple(specs)
        self._hurry = hurry
        offsets, total, pieces = arena_layout(self.specs, register_piece_bytes() if pin else 0)
        self.nbytes = total
        self.pieces = pieces
        """``(start, stop)`` byte ranges page-locked one at a time (see :func:`arena_layout`)."""
        self._shared = _shared_slab(total) if (sharedmem.supported() if shared is None else shared) and total else None
        if self._shared is not None:
            self._slab = torch.from_numpy(self._shared.array)
        elif pin and total:
            self._slab = _private_slab(total)  # page-aligned, like a shared slab: the pieces start on pages
        else:
            self._slab = torch.empty(max(total, 1), dtype=torch.uint8)
        self.pinned = False
        self._registered: list[int] = []
        self.prepare_secs: dict[str, float] = {}
        """Seconds this arena's preparation took: ``populate`` (allocating its pages) and ``register``
        (page-locking them, pauses included), for the manager's stats and the benchmarks."""
        if pin and total:
            t0 = time.perf_counter()
            if os.environ.get(POPULATE_STAGING_ENV, "1").strip() != "0":
                # see pagemem: allocated here, not inside the registration
                pagemem.populate_write(self._slab.data_ptr(), self._slab.nbytes, threads=populate_threads())
            t1 = time.perf_counter()
            self.pinned = self._register_pinned()
            self.prepare_secs = {"populate": t1 - t0, "register": time.perf_counter() - t1}
        flat = self._slab.numpy()
        self.buffers: list[torch.Tensor] = []
        for (shape, stride, dtype), off in zip(self.specs, offsets):
            nbytes = _span_elems(shape, stride) * dtype.itemsize
            if nbytes == 0:
                self.buffers.append(torch.empty_strided(shape, stride, dtype=dtype))
                continue
            region = torch.frombuffer(flat[off : off + nbytes], dtype=torch.uint8)
            self.buffers.append(region.view(dtype).as_strided(shape, stride))
        self.busy = False

    def _register_pinned(self) -> bool:
        """Page-lock the arena piece by piece, pausing after each (by default 3x as long as it took).

        Why pieces: the driver holds the training thread's CUDA calls while it registers memory. In one
        call, the 4.83 GB reference arena held them for 0.15-0.37 s and a 20 GB one for ~1 s: one
        step that much longer (H200, sessions 17-18). A 256 MiB piece holds them for a few
        milliseconds, and the pause (3x the piece's time by default) lets the GPU's queue refill in
        between: the same registration then cost the steps around it ~150 ms in all at 20 GB, no step
        more than +13.5 ms (pauses as long as the pieces: 470-600 ms; at 4.83 GB 40-52 ms;
        ``benchmarks/RESULTS.md``, session 18).
        The pauses stretch the preparation (20 GB: ~4.7 s instead of ~1 s), so a save that has to
        wait for the arena sets ``hurry`` and the rest is registered without them.
        """
        base = self._slab.data_ptr()
        pause = register_pause()
        try:
            for k, (start, stop) in enumerate(self.pieces):
                t0 = time.perf_counter()
                self._register_piece(base + start, stop - start)
                self._registered.append(base + start)
                if pause > 0 and k + 1 < len(self.pieces):
                    self._pause(pause * (time.perf_counter() - t0))
            return True
        except Exception as exc:  # fall back to pageable memory: correct, just slower copies
            self._unregister()
            logger.warning("checkpointd: could not pin %d bytes of staging memory (%s); using pageable memory", self._slab.nbytes, exc)
            return False

    def _pause(self, secs: float) -> None:
        if self._hurry is None:
            time.sleep(secs)
        else:
            self._hurry.wait(secs)  # returns at once when a save is waiting

    @staticmethod
    def _register_piece(ptr: int, nbytes: int) -> None:
        err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister returned {err}")

    def _unregister(self) -> None:
        for ptr in self._registered:
            try:
                torch.cuda.cudart().cudaHostUnregister(ptr)
            except Exception:  # pragma: no cover
                pass
        self._registered = []

    def release(self) -> None:
        """Unpin; the memory itself goes when the last reference does."""
        self._unregister()
        if self._shared is not None:
            self._shared.release()
        self.buffers = []


class DeviceClone:
    """Device staging: the clone of the live CUDA tensors into the private GPU buffers, on the side stream.

    Why on the side stream: on the compute stream the clone lengthened the save step by its whole
    duration (20 GB: ~10 ms at 2 TB/s, on top of the call). Why queued lazily, like the pinned mode's
    copies (at the registered modules' next forward or optimizers' next step, :meth:`order`, or when
    the device-to-host copies that read it are queued): a loop that synchronizes the whole device at
    the end of each step (``torch.cuda.synchronize()``, as the benchmarks and the issue's reference
    loop do) waits for side-stream work too, so a clone queued in ``maybe_save`` still lengthened the
    save step (measured: 22-24 ms at 20 GB either way, H200). Queued at the next forward, it runs under
    forward and backward; training waits for it on the GPU only where it would modify a source: the
    forward for the module buffers (cloned first), the optimizer step for everything. The
    device-to-host copies that follow on the same stream are ordered after it without any event.
    """

    def __init__(self, sources: list[torch.Tensor], buffers: list[torch.Tensor], n_buffers: int,
                 save_point: Any, stream: Any) -> None:
        self._sources: list[torch.Tensor] | None = sources
        """Held until the compute stream waited for the clone: memory freed before that could be reused
        by the compute stream while the side stream still reads it (cheaper than ``record_stream`` on
        every source)."""
        self.buffers = buffers
        """The private GPU buffers (the snapshotter's reused device arena) that the clone fills; the
        device-to-host copies read them."""
        self._n_buffers = n_buffers
        self._save_point = save_point
        self._stream = stream
        self._lock = threading.Lock()
        self.buffers_done: Any = None
        self.done: Any = None
        """The event after the whole clone; None until it is queued."""
        self.waited_buffers = n_buffers == 0
        self.waited_all = False

    def queue(self) -> None:
        """Queue the clone on the side stream, after the save point (once; any thread)."""
        if self.done is not None:
            return
        with self._lock:
            if self.done is not None:
                return
            sources, buffers, n, stream = self._sources, self.buffers, self._n_buffers, self._stream
            assert sources is not None
            with torch.cuda.device(stream.device), torch.cuda.stream(stream), torch.no_grad():
                stream.wait_event(self._save_point)
                if n:
                    torch._foreach_copy_(buffers[:n], sources[:n])
                    self.buffers_done = torch.cuda.Event()
                    self.buffers_done.record(stream)
                if len(sources) > n:
                    torch._foreach_copy_(buffers[n:], sources[n:])
                done = torch.cuda.Event()
                done.record(stream)
            self.done = done

    def order(self, current: Any, all_copies: bool) -> None:
        """Make the compute stream wait for the buffers' clone, or (``all_copies``) the whole clone."""
        self.queue()
        if all_copies:
            if not self.done.query():
                current.wait_event(self.done)
            self.waited_all = self.waited_buffers = True
            self._sources = None
        elif not self.waited_buffers:
            if not self.buffers_done.query():
                current.wait_event(self.buffers_done)
            self.waited_buffers = True


class PendingCopies:
    """The device-to-host copies of one snapshot: queued lazily, then tracked by CUDA events.

    Thread-safe: the training thread's hooks and the background writer may both try to queue them.
    """

    def __init__(self, snapshotter: "Snapshotter | None" = None, pairs: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                 n_buffers: int = 0, save_point: Any = None, device: torch.device | None = None,
                 nbytes: int = 0, clone: DeviceClone | None = None) -> None:
        self._snap = snapshotter
        self.defer_planning = bool(pairs) and nbytes >= PLAN_DEFER_MIN_BYTES
        """Whether the committer waits for :attr:`training_waits` before planning (large snapshots)."""
        self.clone = clone
        """Device staging: the clone the copies read from (training waits for it, not for the copies)."""
        self._pairs = pairs or []
        self._n_buffers = n_buffers
        self._save_point = save_point
        self._device = device
        self._lock = threading.Lock()
        self.buffers_done: Any = None
        self.all_done: Any = None
        self.waited_buffers = False
        self.waited_all = False
        self._started = False
        self.enqueued = threading.Event()
        self.training_waits = threading.Event()
        """Set when the training thread reached the next optimizer step after the save (its hook), or
        anything waited for these copies. With :attr:`defer_planning` the committer plans the files
        after it: the training thread is then about to wait for the GPU (the copy, or the step's
        compute), holding no GIL, so the planning's Python runs in that wait instead of taking the GIL
        while the save step waits for the device clone, or the forward after it is launched. Set at
        once when there is nothing to copy (CPU-only: copied in ``maybe_save``)."""
        if not self._pairs:
            self.enqueued.set()
            self.training_waits.set()

    @property
    def private_source(self) -> bool:
        """True when the copies read a private device-staging buffer: training never waits for them."""
        return self.clone is not None

    def enqueue(self, max_bytes: int | None = None) -> None:
        """Queue the copies on the side stream, ordered after the save point.

        Args:
            max_bytes: for copies from a private device-staging buffer, queue at most this many bytes
                now (paced over the next steps so each step's copy hides under its compute); None
                queues everything left. Copies from live tensors are always queued at once.
        """
        if self.enqueued.is_set():
            return
        with self._lock:
            if self.enqueued.is_set():
                return
            assert self._snap is not None and self._device is not None
            if not self.private_source:
                max_bytes = None
            stream = self._snap._side_stream(self._device)
            if self.clone is not None:
                self.clone.queue()  # the copies read the clone: same stream, queued after it
            with torch.cuda.device(self._device), torch.cuda.stream(stream), torch.no_grad():
                if not self._started:
                    stream.wait_event(self._save_point)
                    self._started = True
                if self._n_buffers:
                    self._copy(self._pairs[: self._n_buffers], stream)
                    self.buffers_done = self._record(stream)
                    self._pairs, self._n_buffers = self._pairs[self._n_buffers :], 0
                taken, nbytes = 0, 0
                while taken < len(self._pairs) and (max_bytes is None or nbytes < max_bytes or taken == 0):
                    nbytes += self._pairs[taken][1].untyped_storage().nbytes()
                    taken += 1
                self._copy(self._pairs[:taken], stream)
                self._pairs = self._pairs[taken:]
                if not self._pairs:
                    self.all_done = self._record(stream)
            if not self._pairs:
                self.enqueued.set()

    @staticmethod
    def _copy(pairs: list[tuple[torch.Tensor, torch.Tensor]], stream: Any) -> None:
        for src, dst in pairs:
            dst.copy_(src, non_blocking=True)
            src.record_stream(stream)

    @staticmethod
    def _record(stream: Any) -> Any:
        event = host_waited_event()  # the writer's thread waits for it: sleeping, not spinning
        event.record(stream)
        return event

    def wait_host(self, grace_secs: float | None = None) -> None:
        """Block the calling thread until every copy landed in host memory.

        Args:
            grace_secs: when called from the background writer, how long to let the training
                thread's hooks queue the copies (so they overlap its next step) before queueing them here.
        """
        if grace_secs is not None:
            self.enqueued.wait(grace_secs)
        self.enqueue()
        self.training_waits.set()
        if self.all_done is not None:
            self.all_done.synchronize()


@dataclass
class StagedTensors:
    staged: list[torch.Tensor]
    arena: StagingArena | None
    copies: Any = field(default_factory=PendingCopies)
    """PendingCopies, or a ChunkStream under a host budget."""
    streamed: dict[int, int] = field(default_factory=dict)
    """Host budget: position in ``staged`` (a placeholder) -> source index in the ChunkStream."""


class Snapshotter:
    """Copies tensors into arenas; owns the arenas, the side stream and the CUDA hooks' waiting logic.

    Called on the training thread; arena preparation runs on a background thread.
    """

    def __init__(self, max_arenas: int = 1, device_budget_bytes: int | None = None,
                 host_budget_bytes: int | None = None,
                 on_arena_ready: "Callable[[StagingArena], None] | None" = None) -> None:
        """``on_arena_ready``: called on the preparing thread with each arena prepared ahead (the
        manager pickles its buffers once there, so the first save's pickling hits the reduction cache)."""
        self.cuda = torch.cuda.is_available()
        self.on_arena_ready = on_arena_ready
        self.device_budget_bytes = device_budget_bytes
        self.host_budget_bytes = host_budget_bytes
        self._ring: Any = None
        self._ring_thread: threading.Thread | None = None
        self.hook_wait_secs = 0.0
        """Seconds the training thread's hooks blocked on the host (host budget: the stall it costs)."""
        self._device_arena: tuple[tuple[TensorSpec, ...], list[torch.Tensor]] | None = None
        self._last_device_copies: PendingCopies | None = None
        self._warned_budget = False
        self._arenas: list[StagingArena] = []
        self._max_arenas = max(1, max_arenas)
        self._lock = threading.Lock()
        self._preparing: dict[tuple[TensorSpec, ...], tuple[threading.Thread, threading.Event]] = {}
        """Per arena in preparation: its thread, and ``hurry``, set when a save waits for it (its
        registration then skips the pauses)."""
        self._streams: dict[int, Any] = {}
        self._inflight: list[PendingCopies] = []
        self.has_step_hooks = False
        """Whether an optimizer's step pre-hook calls :meth:`wait_for_all` (else the forward's hook
        tells the committer that the training thread moved on, see ``PendingCopies.training_waits``)."""
        self.pinned_bytes = 0
        self.arena_allocations = 0
        self.arena_wait_secs = 0.0
        """Seconds saves waited for an arena still being prepared (a first save soon after the start)."""
        self.last_prepare_secs: dict[str, float] = {}
        """The latest pinned arena's :attr:`StagingArena.prepare_secs`."""
        if host_budget_bytes is not None and self.cuda:
            self._prepare_ring_async()  # layout-independent: allocate and pin it now, in the background
        if host_budget_bytes is not None and not self.cuda and not STREAM_CPU_TENSORS:
            logger.info("checkpointd: host_staging_budget_bytes is ignored without CUDA: CPU tensors are "
                        "copied inside maybe_save, so the whole state is staged there")

    # -- arenas ----------------------------------------------------------------------------------
    def prepare_async(self, specs: Sequence[TensorSpec], cuda_device: torch.device | None = None,
                      cuda_mask: Sequence[bool] = ()) -> None:
        """Allocate (and pin) an arena for ``specs`` on a background thread, if none fits yet.

        With device staging on, also allocate the GPU staging buffer for the specs flagged in
        ``cuda_mask`` (on ``cuda_device``), so the first save pays no allocation either.
        """
        key = tuple(specs)
        device_key = tuple(sp for sp, on_cuda in zip(specs, cuda_mask) if on_cuda)
        pin = self.cuda and (not cuda_mask or any(cuda_mask))  # see snapshot(): CPU-only state is not pinned
        if self._ring_mode(cuda_mask):  # host budget: the ring, plus an unpinned arena for CPU tensors
            self._prepare_ring_async()
            key = tuple(sp for sp, on_cuda in zip(specs, cuda_mask) if not self._streamed_device(on_cuda))
            pin = False
            if not key and not device_key:
                return
        with self._lock:
            if key in self._preparing or any(a.specs == key for a in self._arenas):
                return
            hurry = threading.Event()
            thread = threading.Thread(target=self._prepare, args=(key, device_key, cuda_device, pin, hurry),
                                      name="checkpointd-arena", daemon=True)
            self._preparing[key] = (thread, hurry)
        thread.start()

    def _prepare(self, key: tuple[TensorSpec, ...], device_key: tuple[TensorSpec, ...] = (),
                 cuda_device: torch.device | None = None, pin: bool | None = None,
                 hurry: threading.Event | None = None) -> None:
        try:
            if key:
                arena = StagingArena(key, pin=self.cuda if pin is None else pin, hurry=hurry)
                with self._lock:
                    self._add_arena(arena)
                if self.on_arena_ready is not None:
                    self.on_arena_ready(arena)
            if device_key and cuda_device is not None and self.device_budget_bytes is not None:
                with torch.cuda.device(cuda_device):
                    buffers = self._ensure_device_arena(device_key, cuda_device)
                    if buffers:
                        _warm_device_clone(buffers)
        except Exception as exc:  # pragma: no cover - allocation failure: the save path retries synchronously
            logger.warning("checkpointd: preparing staging buffers failed: %s", exc)
        finally:
            with self._lock:
                self._preparing.pop(key, None)

    def _ensure_device_arena(self, key: tuple[TensorSpec, ...], device: torch.device) -> list[torch.Tensor] | None:
        """The reused GPU staging buffers for ``key``; None when they would exceed the budget."""
        assert self.device_budget_bytes is not None
        arena = self._device_arena
        if arena is not None and arena[0] == key:
            return arena[1]
        nbytes = sum(_span_elems(sh, st) * dt.itemsize for sh, st, dt in key)
        if nbytes > self.device_budget_bytes:
            if not self._warned_budget:
                logger.warning("checkpointd: %d bytes of CUDA state exceed device_staging_budget_bytes=%d; "
                               "staging through host memory", nbytes, self.device_budget_bytes)
                self._warned_budget = True
            return None
        buffers = [torch.empty_strided(sh, st, dtype=dt, device=device) for sh, st, dt in key]
        self._device_arena = (key, buffers)
        return buffers

    def _add_arena(self, arena: StagingArena) -> None:
        self.arena_allocations += 1
        if arena.pinned:
            self.pinned_bytes += arena.nbytes
            self.last_prepare_secs = dict(arena.prepare_secs, pieces=len(arena.pieces))
        self._arenas.append(arena)
        # Drop idle arenas of other layouts beyond the budget (a layout change, e.g. optimizer state appearing).
        while len(self._arenas) > self._max_arenas:
            idle = [a for a in self._arenas if not a.busy and a is not arena]
            if not idle:
                break
            victim = idle[0]
            self._arenas.remove(victim)
            if victim.pinned:
                self.pinned_bytes -= victim.nbytes
            victim.release()

    def _acquire(self, specs: tuple[TensorSpec, ...], pin: bool | None = None) -> StagingArena:
        with self._lock:
            preparing = self._preparing.get(specs)
        if preparing is not None:
            thread, hurry = preparing
            hurry.set()
            t0 = time.perf_counter()
            thread.join()
            self.arena_wait_secs += time.perf_counter() - t0
        with self._lock:
            for arena in self._arenas:
                if arena.specs == specs and not arena.busy:
                    arena.busy = True
                    return arena
        arena = StagingArena(specs, pin=self.cuda if pin is None else pin)  # layout changed or all busy: allocate now
        arena.busy = True
        with self._lock:
            self._add_arena(arena)
        return arena

    def release(self, staged: StagedTensors) -> None:
        """Return a snapshot's arena to the pool (called once its files are written)."""
        if isinstance(staged.copies, ChunkStream):
            staged.copies.close()  # frees the ring for the next save; unblocks hooks if the save failed
        if staged.arena is not None:
            with self._lock:
                staged.arena.busy = False

    def preparing(self) -> bool:
        """Whether staging buffers (an arena, the host budget's ring) are being allocated and page-locked
        on a background thread now."""
        with self._lock:
            threads = [thread for thread, _ in self._preparing.values()]
        ring = self._ring_thread
        return any(t.is_alive() for t in threads) or (ring is not None and ring.is_alive())

    def close(self) -> None:
        with self._lock:
            threads = []
            for thread, hurry in self._preparing.values():
                hurry.set()  # nothing to leave room for any more: register the rest without pauses
                threads.append(thread)
        if self._ring_thread is not None:
            threads.append(self._ring_thread)
        for t in threads:
            t.join()
        with self._lock:
            for a in self._arenas:
                a.release()
            self._arenas.clear()
            self._device_arena = None
            if self._ring is not None:
                self._ring.close()
                self._ring = None
            self.pinned_bytes = 0

    # -- host budget: the chunk ring ------------------------------------------------------------
    @property
    def needs_hooks(self) -> bool:
        """Whether training must be held by the optimizer/forward hooks (CUDA, or the CPU test mode)."""
        return self.cuda or (self.host_budget_bytes is not None and STREAM_CPU_TENSORS)

    def _streamed_device(self, on_cuda: bool) -> bool:
        return on_cuda or STREAM_CPU_TENSORS

    def _ring_mode(self, on_cuda: Sequence[bool]) -> bool:
        """Whether a save of tensors with this device mask goes through the chunk ring."""
        if self.host_budget_bytes is None:
            return False
        return (self.cuda and any(on_cuda)) or (STREAM_CPU_TENSORS and len(on_cuda) > 0)

    def _prepare_ring_async(self) -> None:
        with self._lock:
            if self._ring is not None or self._ring_thread is not None:
                return
            self._ring_thread = threading.Thread(target=self._make_ring, name="checkpointd-ring", daemon=True)
        self._ring_thread.start()

    def _make_ring(self) -> None:
        from checkpointd.save.chunkstream import ChunkRing, ring_geometry

        assert self.host_budget_bytes is not None
        chunk, n = ring_geometry(self.host_budget_bytes)
        if chunk * n > self.host_budget_bytes:
            logger.warning("checkpointd: host_staging_budget_bytes=%d is below the floor of %d chunks of %d bytes; "
                           "staging through %d bytes", self.host_budget_bytes, n, chunk, chunk * n)
        try:
            ring = ChunkRing(chunk, n, pin=self.cuda)
        except Exception as exc:  # pragma: no cover - the save path retries synchronously
            logger.warning("checkpointd: allocating the host staging ring failed: %s", exc)
            return
        with self._lock:
            if self._ring is None:
                self._ring = ring
                self.arena_allocations += 1
                if ring.pinned:
                    self.pinned_bytes += ring.nbytes

    def _ensure_ring(self) -> Any:
        thread = self._ring_thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        if self._ring is None:
            self._make_ring()
        if self._ring is None:
            raise RuntimeError("checkpointd: could not allocate the host staging ring")
        return self._ring

    # -- copying ---------------------------------------------------------------------------------
    def snapshot(self, tensors: Sequence[torch.Tensor], n_buffer_tensors: int = 0) -> StagedTensors:
        """Copy ``tensors`` into an arena; the first ``n_buffer_tensors`` are module buffers (copied first).

        Returns at once on CUDA (copies queued on a side stream); synchronous otherwise.
        """
        specs = tuple(tensor_spec(t) for t in tensors)
        on_cuda = [t.is_cuda for t in tensors]
        if self._ring_mode(on_cuda):
            return self._snapshot_streamed(tensors, specs, n_buffer_tensors)
        # Pinned only for device-to-host copies: a CPU-only state on a CUDA host gains nothing from
        # page-locked buffers (its copies are memcpy), and page-locking would bring up a CUDA context in
        # a process that never used one (GPU memory, seconds, and the CUDA RNG state entering the next
        # save's layout, so that save allocates again).
        arena = self._acquire(specs, pin=self.cuda and any(on_cuda))
        staged = list(arena.buffers)
        device_idx = [i for i, cuda in enumerate(on_cuda) if cuda]
        with torch.no_grad():  # no autograd here, so the sources need no detach()
            for i, t in enumerate(tensors):
                if not on_cuda[i]:
                    staged[i].copy_(t)
        copies = PendingCopies()
        if device_idx:
            device = tensors[device_idx[0]].device
            sources = [tensors[i] for i in device_idx]
            n_buf = sum(1 for i in device_idx if i < n_buffer_tensors)
            save_point = torch.cuda.Event()
            save_point.record(torch.cuda.current_stream(device))
            clone = self._stage_on_device(sources, [specs[i] for i in device_idx], device, save_point, n_buf)
            pairs = list(zip(clone.buffers if clone is not None else sources, [staged[i] for i in device_idx]))
            copies = PendingCopies(self, pairs, 0 if clone is not None else n_buf, save_point, device,
                                   nbytes=arena.nbytes, clone=clone)
            if clone is not None:
                self._last_device_copies = copies
            self._inflight.append(copies)
        return StagedTensors(staged=staged, arena=arena, copies=copies)

    def _snapshot_streamed(self, tensors: Sequence[torch.Tensor], specs: tuple[TensorSpec, ...],
                           n_buffer_tensors: int) -> StagedTensors:
        """Host budget: placeholders for the streamed tensors, a ChunkStream that the writer runs.

        Only CPU tensors (which may change right after ``maybe_save``) are copied now, into a reused
        unpinned arena. Device staging, when on and the state fits, still clones first: the stream
        then reads that private copy and training never waits.
        """
        from checkpointd.save.chunkstream import ChunkStream, CpuCopier, CudaCopier

        streamed = [i for i, t in enumerate(tensors) if self._streamed_device(t.device.type == "cuda")]
        streamed_set = set(streamed)
        local = [i for i in range(len(tensors)) if i not in streamed_set]
        ring = self._ensure_ring()
        arena = self._acquire(tuple(specs[i] for i in local), pin=False) if local else None
        staged: list[torch.Tensor] = [None] * len(tensors)  # type: ignore[list-item]
        with torch.no_grad():
            for j, i in enumerate(local):
                assert arena is not None
                arena.buffers[j].copy_(tensors[i].detach())
                staged[i] = arena.buffers[j]
        for i in streamed:
            shape, stride, dtype = specs[i]
            staged[i] = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
        sources = [tensors[i].detach() for i in streamed]
        n_early = sum(1 for i in streamed if i < n_buffer_tensors)
        clone = None
        if self.cuda and sources and sources[0].device.type == "cuda":
            device = sources[0].device
            save_point = torch.cuda.Event()
            save_point.record(torch.cuda.current_stream(device))
            clone = self._stage_on_device(sources, [specs[i] for i in streamed], device, save_point, n_early)
            copier: CpuCopier = CudaCopier(self._side_stream(device), save_point, device,
                                           before=clone.queue if clone is not None else None)
        else:
            copier = CpuCopier()
        stream = ChunkStream(ring, copier, clone.buffers if clone is not None else sources,
                             0 if clone is not None else n_early, clone=clone)
        if clone is not None:
            self._last_device_copies = stream  # type: ignore[assignment]
        self._inflight.append(stream)  # type: ignore[arg-type]
        return StagedTensors(staged=staged, arena=arena, copies=stream,
                             streamed={pos: k for k, pos in enumerate(streamed)})

    def _stage_on_device(self, sources: list[torch.Tensor], specs: Sequence[TensorSpec], device: torch.device,
                         save_point: Any, n_buffers: int) -> DeviceClone | None:
        """Device staging (opt-in): the :class:`DeviceClone` into the reused GPU buffers (queued later).

        A device-to-device copy runs at ~2 TB/s; training waits for it on the GPU at its next forward
        (module buffers) and optimizer step, never for the slower device-to-host copy, which then reads
        the private GPU copy. Returns None (host staging) when the state does not fit the GPU budget.
        """
        if self.device_budget_bytes is None:
            return None
        buffers = self._ensure_device_arena(tuple(specs), device)
        if buffers is None:
            return None
        prev = self._last_device_copies
        # The previous save's device-to-host copies still read these buffers. They run on the same
        # side stream, so the clone is ordered after them once they are all queued.
        if isinstance(prev, ChunkStream):  # host budget: the writer issues them as chunks free up
            if not prev.all_issued.is_set():
                t0 = time.perf_counter()
                prev.all_issued.wait()
                self.hook_wait_secs += time.perf_counter() - t0
        elif prev is not None:
            prev.enqueue()
        return DeviceClone(sources, buffers, n_buffers, save_point, self._side_stream(device))

    def _side_stream(self, device: torch.device) -> Any:
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._streams:
            self._streams[index] = torch.cuda.Stream(device=index)
        return self._streams[index]

    # -- waits (called from hooks on the training thread) -----------------------------------------
    def wait_for_buffers(self) -> None:
        """Order the current stream after the module-buffer copies of every snapshot in flight."""
        self._wait(all_copies=False)

    def wait_for_all(self) -> None:
        """Order the current stream after every copy in flight (before an optimizer step)."""
        self._wait(all_copies=True)

    def _wait(self, all_copies: bool) -> None:
        if not self._inflight:
            return
        current: Any = None
        still: list[Any] = []
        for c in self._inflight:
            clone = c.clone
            if clone is not None and not clone.waited_all:  # device staging: wait (on the GPU) for the clone only
                if current is None:
                    current = torch.cuda.current_stream()
                clone.order(current, all_copies)
            clone_pending = clone is not None and not clone.waited_all
            if isinstance(c, ChunkStream):  # host budget: the copies leave only as chunks free up
                if c.private_source:
                    if not c.all_issued.is_set() or clone_pending:
                        still.append(c)
                    continue
                if not all_copies and c.waited_buffers:
                    still.append(c)
                    continue
                t0 = time.perf_counter()
                c.wait_copied(all_copies)
                self.hook_wait_secs += time.perf_counter() - t0
                c.waited_buffers = True
                if not all_copies:
                    still.append(c)
                continue
            if current is None:
                current = torch.cuda.current_stream()
            if all_copies or not self.has_step_hooks:
                c.training_waits.set()
            if c.private_source:  # training never waits for these; just keep them flowing
                c.enqueue(max_bytes=DEVICE_PACE_BYTES)
                if not c.enqueued.is_set() or not c.training_waits.is_set() or clone_pending:
                    still.append(c)  # kept for the optimizer's hook
                continue
            c.enqueue()
            if all_copies:
                if not c.waited_all and c.all_done is not None and not c.all_done.query():
                    current.wait_event(c.all_done)
                c.waited_all = True
            else:
                if not c.waited_buffers and c.buffers_done is not None and not c.buffers_done.query():
                    current.wait_event(c.buffers_done)
                c.waited_buffers = True
                still.append(c)
        self._inflight = still if not all_copies else [c for c in still if c.private_source]

    def flush(self) -> None:
        """Queue every pending copy now (before the next save point, or before waiting)."""
        for c in list(self._inflight):
            c.enqueue()
            if isinstance(c, PendingCopies):
                c.training_waits.set()

    def wait_host(self) -> None:
        """Block the host until every copy in flight is done (``wait_for_snapshot``)."""
        inflight, self._inflight = self._inflight, []
        for c in inflight:
            c.wait_host()
