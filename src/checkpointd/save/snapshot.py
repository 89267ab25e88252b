"""Snapshot: copy every registered tensor into reused CPU buffers, without stalling training on CUDA.

:class:`Snapshotter` is the training thread's side of a save. It keeps the reused staging buffers
(:mod:`~checkpointd.save.arena`: one host arena per layout, prepared and page-locked ahead on a
background thread, which also pickles a new arena's buffers once through the manager's
``on_arena_ready`` and, with device staging, launches the clone's kernel once), starts each snapshot's
copies and answers the training hooks' waits:

- **CUDA.** ``maybe_save`` records the save point and returns; the copies run on a side stream under
  the next forward and backward, and the compute stream waits for them only where training would
  modify a source (:mod:`~checkpointd.save.device_copies`; device staging clones into private GPU
  buffers first).
- **CPU-only torch.** Pinned memory, streams and events do not exist there: the arena is plain memory
  and the copy is synchronous inside ``maybe_save``, so any mutation afterwards is safe.
- **Host budget (opt-in).** With ``host_budget_bytes`` the CUDA tensors are not staged into an arena
  at all: the snapshot hands out placeholders (meta tensors of the same layout, so the files can be
  planned and pickled) and a :class:`~checkpointd.save.chunkstream.ChunkStream` that the writer runs
  through a fixed ring of pinned chunks (:mod:`~checkpointd.save.chunkring`, made ahead, reused). The
  hooks then wait on the host until the bytes left the device. CPU-resident tensors are still copied
  in ``maybe_save`` (into an unpinned reused arena). On CPU-only torch the budget is ignored (logged):
  CPU tensors may change right after ``maybe_save``, so they must be copied there.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from checkpointd.codecs import encode_device
from checkpointd.save.arena import StagingArena, TensorSpec, tensor_spec
from checkpointd.save.chunkring import ChunkRing, RingKeeper
from checkpointd.save.chunkstream import ChunkStream
from checkpointd.save.copiers import CpuCopier, CudaCopier
from checkpointd.save.device_copies import (DEVICE_PACE_BYTES, DeviceArena, DeviceClone, PendingCopies,
                                            warm_device_clone)

logger = logging.getLogger("checkpointd")

STREAM_CPU_TENSORS = False
"""Testing only: with a host budget, stream CPU tensors through the chunk ring too (plain copies, hooks
installed) so CPU-only tests exercise the budget path. Unsafe for real runs: on CPU anything may modify a
tensor right after ``maybe_save``, not only the hooked optimizer step and forward."""


@dataclass
class StagedTensors:
    """One snapshot: the staged tensors (in the order given), their arena and their copies in flight."""

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
        self._ring_keeper = RingKeeper(host_budget_bytes, self._ring_ready) if host_budget_bytes is not None else None
        self.hook_wait_secs = 0.0
        """Seconds the training thread's hooks blocked on the host (host budget: the stall it costs)."""
        self.device_arena = DeviceArena(device_budget_bytes) if device_budget_bytes is not None else None
        """Device staging's reused GPU buffers (None without a device budget)."""
        self.device_encodes: Callable[[torch.Tensor], bool] | None = None
        """Device staging: which cloned tensors the writer encodes on the device instead of copying them
        to the host (:func:`checkpointd.save.device_encode.encodes_for`), in a save written at full speed
        (a preemption save) where the device budget leaves room for the encoder beside the clone
        (``encode_device.WORK_BYTES``); None: all are copied."""
        self._last_device_copies: PendingCopies | ChunkStream | None = None
        self._arenas: list[StagingArena] = []
        self._max_arenas = max(1, max_arenas)
        self._lock = threading.Lock()
        self._preparing: dict[tuple[TensorSpec, ...], tuple[threading.Thread, threading.Event]] = {}
        """Per arena in preparation: its thread, and ``hurry``, set when a save waits for it (its
        registration then skips the pauses)."""
        self._streams: dict[int, Any] = {}
        self._inflight: list[PendingCopies | ChunkStream] = []
        self.has_step_hooks = False
        """Whether an optimizer's step pre-hook calls :meth:`wait_for_all` (else the forward's hook
        tells the committer that the training thread moved on, see ``PendingCopies.training_waits``)."""
        self.pinned_bytes = 0
        self.arena_allocations = 0
        self.arena_wait_secs = 0.0
        """Seconds saves waited for an arena still being prepared (a first save soon after the start)."""
        self.last_prepare_secs: dict[str, float] = {}
        """The latest pinned arena's :attr:`StagingArena.prepare_secs`."""
        if self._ring_keeper is not None and self.cuda:
            self._ring_keeper.start(pin=True)  # layout-independent: allocate and pin it now, in the background
        if host_budget_bytes is not None and not self.cuda and not STREAM_CPU_TENSORS:
            logger.info("checkpointd: StagingOptions.host_budget_bytes is ignored without CUDA: CPU tensors are "
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
            assert self._ring_keeper is not None
            self._ring_keeper.start(pin=self.cuda)
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
            if device_key and cuda_device is not None and self.device_arena is not None:
                with torch.cuda.device(cuda_device):
                    buffers = self.device_arena.buffers(device_key, cuda_device)
                    if buffers:
                        warm_device_clone(buffers)
        except Exception as exc:  # pragma: no cover - allocation failure: the save path retries synchronously
            logger.warning("checkpointd: preparing staging buffers failed: %s", exc)
        finally:
            with self._lock:
                self._preparing.pop(key, None)

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
        else:
            staged.copies.device_reads_done.set()  # (a save that failed before its encoding)
        if staged.arena is not None:
            with self._lock:
                staged.arena.busy = False

    def preparing(self) -> bool:
        """Whether staging buffers (an arena, the host budget's ring) are being allocated and page-locked
        on a background thread now."""
        with self._lock:
            threads = [thread for thread, _ in self._preparing.values()]
        return any(t.is_alive() for t in threads) or (self._ring_keeper is not None and self._ring_keeper.preparing())

    def close(self) -> None:
        with self._lock:
            threads = []
            for thread, hurry in self._preparing.values():
                hurry.set()  # nothing to leave room for any more: register the rest without pauses
                threads.append(thread)
        for t in threads:
            t.join()
        if self._ring_keeper is not None:
            self._ring_keeper.close()
        with self._lock:
            for a in self._arenas:
                a.release()
            self._arenas.clear()
            if self.device_arena is not None:
                self.device_arena.clear()
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

    @property
    def ring(self) -> ChunkRing | None:
        """The host budget's chunk ring, once made."""
        return self._ring_keeper.ring if self._ring_keeper is not None else None

    def _ring_ready(self, ring: ChunkRing) -> None:
        with self._lock:
            self.arena_allocations += 1
            if ring.pinned:
                self.pinned_bytes += ring.nbytes

    # -- copying ---------------------------------------------------------------------------------
    def snapshot(self, tensors: Sequence[torch.Tensor], n_buffer_tensors: int = 0,
                 encode_on_device: bool = False) -> StagedTensors:
        """Copy ``tensors`` into an arena; the first ``n_buffer_tensors`` are module buffers (copied first).

        Returns at once on CUDA (copies queued on a side stream); synchronous otherwise.
        ``encode_on_device``: a save written at full speed (a preemption save): with device staging, the
        tensors :attr:`device_encodes` picks are encoded on the GPU by the writer instead of copied.
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
            encoded = []
            if encode_on_device and clone is not None and self.device_encodes is not None and (
                    self.device_arena is not None and self.device_arena.spare_bytes >= encode_device.WORK_BYTES):
                picked = [self.device_encodes(src) for src, _ in pairs]
                encoded = [pair for pair, pick in zip(pairs, picked) if pick]
                pairs = [pair for pair, pick in zip(pairs, picked) if not pick]
            copies = PendingCopies(pairs, 0 if clone is not None else n_buf, save_point, device,
                                   self._side_stream(device), nbytes=arena.nbytes, clone=clone, encoded=encoded)
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
        streamed = [i for i, t in enumerate(tensors) if self._streamed_device(t.device.type == "cuda")]
        streamed_set = set(streamed)
        local = [i for i in range(len(tensors)) if i not in streamed_set]
        assert self._ring_keeper is not None
        ring = self._ring_keeper.get(pin=self.cuda)
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
            self._last_device_copies = stream
        self._inflight.append(stream)
        return StagedTensors(staged=staged, arena=arena, copies=stream,
                             streamed={pos: k for k, pos in enumerate(streamed)})

    def _stage_on_device(self, sources: list[torch.Tensor], specs: Sequence[TensorSpec], device: torch.device,
                         save_point: Any, n_buffers: int) -> DeviceClone | None:
        """Device staging (opt-in): the :class:`DeviceClone` into the reused GPU buffers (queued later).

        A device-to-device copy runs at ~2 TB/s; training waits for it on the GPU at its next forward
        (module buffers) and optimizer step, never for the slower device-to-host copy, which then reads
        the private GPU copy. Returns None (host staging) when the state does not fit the GPU budget.
        """
        if self.device_arena is None:
            return None
        buffers = self.device_arena.buffers(tuple(specs), device)
        if buffers is None:
            return None
        prev = self._last_device_copies
        if isinstance(prev, PendingCopies) and not prev.device_reads_done.is_set():
            t0 = time.perf_counter()  # the writer still encodes the previous save from these buffers
            prev.device_reads_done.wait()
            self.hook_wait_secs += time.perf_counter() - t0
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


__all__ = ["STREAM_CPU_TENSORS", "Snapshotter", "StagedTensors"]
