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
  prepared ahead on a background thread (after construction and after the first optimizer step,
  when optimizer state first exists), off the training thread's critical path.
- **Side stream, no host wait.** Device-to-host copies are queued on a side stream after the compute
  stream's pending work; ``maybe_save`` returns at once. Before anything can modify a snapshotted
  tensor, the compute stream (not the host) waits on an event: registered modules' forward pre-hook
  waits for the module buffers (copied first, e.g. BatchNorm running stats), registered optimizers'
  step pre-hook waits for everything. Copies that are done cost nothing.
- **CPU-only torch.** Pinned memory, streams and events do not exist there: the arena is plain memory
  and the copy is synchronous inside ``maybe_save``, so any mutation afterwards is safe.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

logger = logging.getLogger("checkpointd")

ALIGN_BYTES = 64
TensorSpec = tuple[tuple[int, ...], tuple[int, ...], torch.dtype]


def tensor_spec(t: torch.Tensor) -> TensorSpec:
    """(shape, staging strides, dtype): the staging strides keep a dense layout, else contiguous."""
    if _is_dense(t):
        stride = tuple(t.stride())
    else:
        stride = tuple(torch.empty(t.shape, dtype=t.dtype, device="meta").stride())
    return tuple(t.shape), stride, t.dtype


def _is_dense(t: torch.Tensor) -> bool:
    try:
        from torch._prims_common import is_non_overlapping_and_dense_or_false as is_non_overlapping_and_dense

        return bool(is_non_overlapping_and_dense(t))
    except Exception:  # pragma: no cover - very old torch
        return t.is_contiguous()


def _span_elems(shape: Sequence[int], stride: Sequence[int]) -> int:
    if any(s == 0 for s in shape):
        return 0
    return 1 + sum((n - 1) * st for n, st in zip(shape, stride))


class StagingArena:
    """One host allocation holding a buffer for each tensor of a given layout signature."""

    def __init__(self, specs: Sequence[TensorSpec], pin: bool) -> None:
        self.specs = tuple(specs)
        offsets, total = [], 0
        for shape, stride, dtype in self.specs:
            offsets.append(total)
            nbytes = _span_elems(shape, stride) * dtype.itemsize
            total += (nbytes + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES
        self.nbytes = total
        self._slab = torch.empty(max(total, 1), dtype=torch.uint8)
        self.pinned = False
        self._registered_ptr: int | None = None
        if pin and total:
            self.pinned = self._register_pinned()
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
        try:
            ptr = self._slab.data_ptr()
            err = torch.cuda.cudart().cudaHostRegister(ptr, self._slab.nbytes, 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister returned {err}")
            self._registered_ptr = ptr
            return True
        except Exception as exc:  # fall back to pageable memory: correct, just slower copies
            logger.warning("checkpointd: could not pin %d bytes of staging memory (%s); using pageable memory", self._slab.nbytes, exc)
            return False

    def release(self) -> None:
        """Unpin; the memory itself goes when the last reference does."""
        if self._registered_ptr is not None:
            try:
                torch.cuda.cudart().cudaHostUnregister(self._registered_ptr)
            except Exception:  # pragma: no cover
                pass
            self._registered_ptr = None
        self.buffers = []


@dataclass
class PendingCopies:
    """The CUDA events of one snapshot in flight (None on a CPU-only snapshot)."""

    buffers_done: Any = None
    all_done: Any = None
    waited_buffers: bool = False
    waited_all: bool = False

    def wait_host(self) -> None:
        """Block the calling (background) thread until every copy landed in host memory."""
        if self.all_done is not None:
            self.all_done.synchronize()


@dataclass
class StagedTensors:
    staged: list[torch.Tensor]
    arena: StagingArena | None
    copies: PendingCopies = field(default_factory=PendingCopies)


class Snapshotter:
    """Copies tensors into arenas; owns the arenas, the side stream and the CUDA hooks' waiting logic.

    Called on the training thread; arena preparation runs on a background thread.
    """

    def __init__(self, max_arenas: int = 1) -> None:
        self.cuda = torch.cuda.is_available()
        self._arenas: list[StagingArena] = []
        self._max_arenas = max(1, max_arenas)
        self._lock = threading.Lock()
        self._preparing: dict[tuple[TensorSpec, ...], threading.Thread] = {}
        self._streams: dict[int, Any] = {}
        self._inflight: list[PendingCopies] = []
        self.pinned_bytes = 0
        self.arena_allocations = 0

    # -- arenas ----------------------------------------------------------------------------------
    def prepare_async(self, specs: Sequence[TensorSpec]) -> None:
        """Allocate (and pin) an arena for ``specs`` on a background thread, if none fits yet."""
        key = tuple(specs)
        with self._lock:
            if key in self._preparing or any(a.specs == key for a in self._arenas):
                return
            thread = threading.Thread(target=self._prepare, args=(key,), name="checkpointd-arena", daemon=True)
            self._preparing[key] = thread
        thread.start()

    def _prepare(self, key: tuple[TensorSpec, ...]) -> None:
        try:
            arena = StagingArena(key, pin=self.cuda)
            with self._lock:
                self._add_arena(arena)
        except Exception as exc:  # pragma: no cover - allocation failure: the save path retries synchronously
            logger.warning("checkpointd: preparing staging buffers failed: %s", exc)
        finally:
            with self._lock:
                self._preparing.pop(key, None)

    def _add_arena(self, arena: StagingArena) -> None:
        self.arena_allocations += 1
        if arena.pinned:
            self.pinned_bytes += arena.nbytes
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

    def _acquire(self, specs: tuple[TensorSpec, ...]) -> StagingArena:
        with self._lock:
            thread = self._preparing.get(specs)
        if thread is not None:
            thread.join()
        with self._lock:
            for arena in self._arenas:
                if arena.specs == specs and not arena.busy:
                    arena.busy = True
                    return arena
        arena = StagingArena(specs, pin=self.cuda)  # layout changed or all busy: allocate now
        arena.busy = True
        with self._lock:
            self._add_arena(arena)
        return arena

    def release(self, staged: StagedTensors) -> None:
        """Return a snapshot's arena to the pool (called once its files are written)."""
        if staged.arena is not None:
            with self._lock:
                staged.arena.busy = False

    def close(self) -> None:
        with self._lock:
            threads = list(self._preparing.values())
        for t in threads:
            t.join()
        with self._lock:
            for a in self._arenas:
                a.release()
            self._arenas.clear()
            self.pinned_bytes = 0

    # -- copying ---------------------------------------------------------------------------------
    def snapshot(self, tensors: Sequence[torch.Tensor], n_buffer_tensors: int = 0) -> StagedTensors:
        """Copy ``tensors`` into an arena; the first ``n_buffer_tensors`` are module buffers (copied first).

        Returns at once on CUDA (copies queued on a side stream); synchronous otherwise.
        """
        specs = tuple(tensor_spec(t) for t in tensors)
        arena = self._acquire(specs)
        staged = list(arena.buffers)
        copies = PendingCopies()
        device_idx = [i for i, t in enumerate(tensors) if t.device.type == "cuda"]
        with torch.no_grad():
            for i, t in enumerate(tensors):
                if t.device.type != "cuda":
                    staged[i].copy_(t.detach())
            if device_idx:
                copies = self._copy_from_cuda(tensors, staged, device_idx, n_buffer_tensors)
        result = StagedTensors(staged=staged, arena=arena, copies=copies)
        if copies.all_done is not None:
            self._inflight.append(copies)
        return result

    def _copy_from_cuda(self, tensors: Sequence[torch.Tensor], staged: list[torch.Tensor], idx: list[int], n_buf: int) -> PendingCopies:
        device = tensors[idx[0]].device
        stream = self._side_stream(device)
        compute = torch.cuda.current_stream(device)
        stream.wait_stream(compute)
        copies = PendingCopies()
        with torch.cuda.stream(stream):
            first = [i for i in idx if i < n_buf]
            rest = [i for i in idx if i >= n_buf]
            for group, attr in ((first, "buffers_done"), (rest, "all_done")):
                for i in group:
                    src = tensors[i].detach()
                    staged[i].copy_(src, non_blocking=True)
                    src.record_stream(stream)
                event = torch.cuda.Event()
                event.record(stream)
                setattr(copies, attr, event)
        return copies

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
        current = torch.cuda.current_stream()
        still: list[PendingCopies] = []
        for c in self._inflight:
            if all_copies:
                if not c.waited_all and c.all_done is not None and not c.all_done.query():
                    current.wait_event(c.all_done)
                c.waited_all = True
            else:
                if not c.waited_buffers and c.buffers_done is not None and not c.buffers_done.query():
                    current.wait_event(c.buffers_done)
                c.waited_buffers = True
                still.append(c)
        self._inflight = still if not all_copies else []

    def wait_host(self) -> None:
        """Block the host until every copy in flight is done (``wait_for_snapshot``)."""
        for c in self._inflight:
            c.wait_host()
        self._inflight = []
