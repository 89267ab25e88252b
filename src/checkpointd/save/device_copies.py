"""The device side of a snapshot: side-stream copies to the host, and device staging's private clone.

- **Side stream, no host wait, overlapped with the next step.** ``maybe_save`` records an event on the
  compute stream (the save point) and returns. The device-to-host copies (:class:`PendingCopies`) are
  queued on a side stream, ordered after that event, at the first moment something could modify a
  snapshotted tensor: the registered modules' next forward (pre-hook) or the registered optimizers'
  next step (pre-hook), or ``wait_for_snapshot``/the next save/``wait``. So they overlap the next
  forward and backward instead of lengthening the save step. The compute stream (not the host) then
  waits on an event: the forward for the module buffers (copied first, e.g. BatchNorm running stats),
  the optimizer step for everything. If no hook fires for a while, the background writer queues them
  itself; ordering after the save-point event keeps them exact either way.
- **Device staging clones on the side stream too.** With ``StagingOptions.device_budget_bytes`` the live
  tensors are first cloned into a private GPU buffer (:class:`DeviceClone`, buffers held by
  :class:`DeviceArena`), queued like the copies and ordered after the save point, so the clone (~10 ms
  for 20 GB at 2 TB/s) runs under the next forward and backward instead of lengthening the save step.
  The compute stream waits for it (on the GPU) at the same two hooks, and the device-to-host copies
  that follow read the private copy, paced over the next steps (:data:`DEVICE_PACE_BYTES`).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Sequence

import torch

from checkpointd.save.arena import TensorSpec, span_elems

logger = logging.getLogger("checkpointd")

DEVICE_PACE_BYTES = 512 << 20
"""Device staging: bytes of device-to-host copy queued per training-thread hook (two per step), so a
step's share of the copy runs under its own compute instead of delaying a later synchronisation."""
PLAN_DEFER_MIN_BYTES = 1 << 30
"""Snapshots of at least this many bytes defer the committer's planning to the training thread's next
optimizer step (:attr:`PendingCopies.training_waits`). Below it the step after the save has no long wait
for the GPU to plan in (the copy hides under forward and backward): deferring costs a 0.45 GB state
2-4 ms a checkpoint, and saves 4-7 ms at 4.83 GB (H100 and H200)."""


def host_waited_event() -> Any:
    """A CUDA event for a copy that a host thread may wait for, made with blocking synchronisation.

    ``Event.synchronize`` on a default event spins a core until the GPU reaches it, and the writer's
    thread waits for every snapshot's device-to-host copy, for as long as the copy runs (8 ms at
    0.45 GB, 44-88 ms at 2.4-4.8 GB), while the training thread of a launch-bound loop issues kernels
    beside it. A blocking event puts the waiter to sleep until the GPU signals it, at the price of a
    wake-up: the committer thread uses 4.1-6.6 ms of CPU per 0.45 GB save with it against 10.7-12.6
    spinning (H200 host). Under a host budget the training thread's hooks wait on these events too.
    """
    return torch.cuda.Event(blocking=True)


def warm_device_clone(buffers: list[torch.Tensor]) -> None:
    """Launch the device-staging clone's kernel once, on one element per dtype, ahead of the first save.

    CUDA loads a kernel's module at its first launch (lazy loading): the clone's
    ``torch._foreach_copy_`` takes 21.7 ms of host time (and 23.7 ms on the GPU) the first time against
    0.6-0.7 ms afterwards (H200, 320 tensors, 4.83 GB), which the first save call would pay. The kernel
    is chosen by dtype, not size, so a tiny copy loads it.
    """
    firsts: dict[torch.dtype, torch.Tensor] = {}
    for b in buffers:
        if b.numel() and b.dtype not in firsts:
            firsts[b.dtype] = b.as_strided((1,), (1,))
    if firsts:
        sources = list(firsts.values())
        with torch.no_grad():
            torch._foreach_copy_([torch.empty_like(x) for x in sources], sources)


class DeviceArena:
    """The reused private GPU buffers of device staging, within ``budget_bytes``."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._held: tuple[tuple[TensorSpec, ...], list[torch.Tensor]] | None = None
        self._warned = False

    def buffers(self, key: tuple[TensorSpec, ...], device: torch.device) -> list[torch.Tensor] | None:
        """The buffers for layout ``key`` (allocated on a layout change); None when they would exceed the budget."""
        held = self._held
        if held is not None and held[0] == key:
            return held[1]
        nbytes = sum(span_elems(sh, st) * dt.itemsize for sh, st, dt in key)
        if nbytes > self.budget_bytes:
            if not self._warned:
                logger.warning("checkpointd: %d bytes of CUDA state exceed StagingOptions.device_budget_bytes=%d; "
                               "staging through host memory", nbytes, self.budget_bytes)
                self._warned = True
            return None
        buffers = [torch.empty_strided(sh, st, dtype=dt, device=device) for sh, st, dt in key]
        self._held = (key, buffers)
        return buffers

    @property
    def spare_bytes(self) -> int:
        """The budget left beside the buffers of the latest layout."""
        held = sum(b.untyped_storage().nbytes() for b in self._held[1]) if self._held is not None else 0
        return self.budget_bytes - held

    @property
    def current(self) -> list[torch.Tensor] | None:
        """The buffers of the latest layout, or None before any."""
        return self._held[1] if self._held is not None else None

    def clear(self) -> None:
        self._held = None


class DeviceClone:
    """Device staging: the clone of the live CUDA tensors into the private GPU buffers, on the side stream.

    On the compute stream the clone would lengthen the save step by its whole duration (20 GB: ~10 ms
    at 2 TB/s). It is queued lazily, like the host copies (at the registered modules' next forward or
    optimizers' next step, :meth:`order`, or when the device-to-host copies that read it are queued):
    a loop that synchronizes the whole device at the end of each step (``torch.cuda.synchronize()``)
    waits for side-stream work too, so a clone queued in ``maybe_save`` would still lengthen the save
    step (22-24 ms at 20 GB, H200). Queued at the next forward, it runs under forward and backward;
    training waits for it on the GPU only where it would modify a source: the forward for the module
    buffers (cloned first), the optimizer step for everything. The device-to-host copies that follow on
    the same stream are ordered after it without any event.
    """

    def __init__(self, sources: list[torch.Tensor], buffers: list[torch.Tensor], n_buffers: int,
                 save_point: Any, stream: Any) -> None:
        self._sources: list[torch.Tensor] | None = sources
        """Held until the compute stream waited for the clone: memory freed sooner could be reused by
        the compute stream while the side stream still reads it (cheaper than ``record_stream`` on
        every source)."""
        self.buffers = buffers
        """The private GPU buffers (:class:`DeviceArena`) that the clone fills; the device-to-host copies
        read them."""
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
    """The device-to-host copies of one snapshot: queued lazily on ``stream``, then tracked by CUDA events.

    Thread-safe: the training thread's hooks and the background writer may both try to queue them.
    Without ``pairs`` there is nothing to copy (CPU-only: copied in ``maybe_save``).
    """

    def __init__(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None, n_buffers: int = 0,
                 save_point: Any = None, device: torch.device | None = None, stream: Any = None,
                 nbytes: int = 0, clone: DeviceClone | None = None,
                 encoded: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()) -> None:
        self.defer_planning = bool(pairs or encoded) and nbytes >= PLAN_DEFER_MIN_BYTES
        """Whether the committer waits for :attr:`training_waits` before planning (large snapshots)."""
        self.clone = clone
        """Device staging: the clone the copies read from (training waits for it, not for the copies)."""
        self.encoded = list(encoded)
        """Device staging with a device encoder: ``(clone buffer, staged host tensor)`` pairs that are not
        copied here; the writer encodes them from the clone (:mod:`checkpointd.save.device_encode`)."""
        self.device_reads_done = threading.Event()
        """Set once nothing reads the clone any more for this snapshot (its encoding is done, or the save
        ended): the next snapshot's clone overwrites it only then."""
        if not self.encoded:
            self.device_reads_done.set()
        self._pairs = list(pairs or [])
        self._n_buffers = n_buffers
        self._save_point = save_point
        self._device = device
        self._stream = stream
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
        once when there is nothing to copy."""
        if not self._pairs and not self.encoded:
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
            assert self._stream is not None and self._device is not None
            if not self.private_source:
                max_bytes = None
            stream = self._stream
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
