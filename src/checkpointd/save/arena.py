"""Staging arenas: one reused host allocation per tensor layout, page-locked ahead of time in pieces.

- **Reused buffers.** A :class:`StagingArena` is one host allocation carved into one buffer per tensor,
  laid out with the source's strides (channels_last stays channels_last). It is reused by every save
  whose tensors have the same shapes, strides and dtypes, so steady-state saves allocate nothing.
  Each buffer owns exactly its bytes (a ``torch.frombuffer`` view), so the serializer writes no
  whole-slab bloat.
- **Pinned, exact size.** On CUDA the arena is page-locked with ``cudaHostRegister`` rather than
  ``pin_memory=True``: PyTorch's caching host allocator rounds every block up to a power of two, which
  would nearly double host memory for a 5 GB state. Registration costs ~0.5 s/GiB, so arenas are
  prepared ahead on a background thread (``Snapshotter.prepare_async``), off the training thread's
  critical path.
- **Pages first, then registration in pieces.** The pages are allocated first (``MADV_POPULATE_WRITE``,
  :mod:`checkpointd.storage.pagemem`, on :func:`populate_threads` threads): registering fresh pages
  allocates them inside the driver call, which holds the training thread's CUDA calls (H200 host,
  4.83 GB: one step of 1.7-2.8 s; populated first, 0.15-0.37 s). The registration goes in pieces of
  :data:`REGISTER_PIECE_BYTES` with pauses between them, so no step waits for more than one piece
  (:meth:`StagingArena._register_pinned`). A save that needs the arena sooner sets ``hurry`` and the
  rest is registered without pauses.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Sequence

import numpy as np
import torch
import torch._prims_common as prims

from checkpointd.storage import pagemem
from checkpointd.storage import persist_process
from checkpointd.storage import sharedmem
from checkpointd.storage.lanes import local_ranks

logger = logging.getLogger("checkpointd")

TensorSpec = tuple[tuple[int, ...], tuple[int, ...], torch.dtype]
"""``(shape, staging strides, dtype)`` of one staged tensor (:func:`tensor_spec`)."""

ALIGN_BYTES = 64
"""Buffers start at this alignment inside an arena."""
PAGE_BYTES = 4096
REGISTER_PIECE_BYTES = 256 << 20
"""Page-lock an arena in pieces of about this many bytes (``0``: in one call). A 256 MiB piece holds the
training thread's CUDA calls for a few milliseconds; the whole 4.83 GB reference arena in one call held
them for 0.15-0.37 s and a 20 GB one for ~1 s (H200)."""
REGISTER_PAUSE = 3.0
"""After each piece, pause this many times as long as the piece took (``0``: no pause), so the GPU's
queue refills in between: at 20 GB the registration then costs the steps around it ~150 ms in all, no
step more than +13.5 ms (H200)."""
POPULATE_THREADS = 4
"""Threads allocating a new arena's pages at most (:func:`populate_threads`)."""
POPULATE_STAGING = True
"""Allocate a new arena's pages (:func:`checkpointd.storage.pagemem.populate_write`) before page-locking
them, so the driver does not allocate them inside ``cudaHostRegister`` while holding the training
thread's CUDA calls."""


def tensor_spec(t: torch.Tensor) -> TensorSpec:
    """(shape, staging strides, dtype): the staging strides keep a dense layout, else contiguous."""
    if is_dense(t):
        stride = tuple(t.stride())
    else:
        stride = tuple(torch.empty(t.shape, dtype=t.dtype, device="meta").stride())
    return tuple(t.shape), stride, t.dtype


def is_dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: any permutation of a contiguous layout (channels_last included)."""
    if t.is_contiguous() or t.is_contiguous(memory_format=torch.channels_last):
        return True
    if t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d):
        return True
    check = getattr(prims, "is_non_overlapping_and_dense_or_false", None) or getattr(prims, "is_non_overlapping_and_dense", None)
    return bool(check(t)) if check is not None else False


def span_elems(shape: Sequence[int], stride: Sequence[int]) -> int:
    """Elements from a strided tensor's first to its last element (the bytes a dense buffer holds)."""
    if any(s == 0 for s in shape):
        return 0
    return 1 + sum((n - 1) * st for n, st in zip(shape, stride))


def populate_threads() -> int:
    """At most :data:`POPULATE_THREADS`, and no more than a quarter of this rank's share of the cores."""
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
        nbytes = span_elems(shape, stride) * dtype.itemsize
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


def private_slab(nbytes: int) -> torch.Tensor:
    """``nbytes`` of anonymous memory, page-aligned (``torch.empty`` aligns to 64 bytes only), released in
    pieces when the last view dies (:class:`checkpointd.storage.pagemem.PiecewiseReleasedMap`)."""
    return torch.from_numpy(np.frombuffer(pagemem.PiecewiseReleasedMap(-1, nbytes), dtype=np.uint8))


def shared_slab(nbytes: int) -> "sharedmem.SharedSlab | None":
    """A shared slab lent to the persist process (started here, off the training thread), or None."""
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


class StagingArena:
    """One host allocation holding a buffer for each tensor of a given layout signature."""

    def __init__(self, specs: Sequence[TensorSpec], pin: bool, shared: bool | None = None,
                 hurry: threading.Event | None = None) -> None:
        """``shared``: in shared memory for the persist process (default: where it runs, see
        :mod:`checkpointd.storage.sharedmem`). ``hurry``: once set (a save is waiting for this arena), the
        pauses between the pieces it is page-locked in are skipped."""
        self.specs = tuple(specs)
        self._hurry = hurry
        offsets, total, pieces = arena_layout(self.specs, REGISTER_PIECE_BYTES if pin else 0)
        self.nbytes = total
        self.pieces = pieces
        """``(start, stop)`` byte ranges page-locked one at a time (see :func:`arena_layout`)."""
        self._shared = shared_slab(total) if (sharedmem.supported() if shared is None else shared) and total else None
        if self._shared is not None:
            self._slab = torch.from_numpy(self._shared.array)
        elif pin and total:
            self._slab = private_slab(total)  # page-aligned, like a shared slab: the pieces start on pages
        else:
            self._slab = torch.empty(max(total, 1), dtype=torch.uint8)
        self.pinned = False
        self._registered: list[int] = []
        self.prepare_secs: dict[str, float] = {}
        """Seconds this arena's preparation took: ``populate`` (allocating its pages) and ``register``
        (page-locking them, pauses included), for the manager's stats and the benchmarks."""
        if pin and total:
            t0 = time.perf_counter()
            if POPULATE_STAGING:
                pagemem.populate_write(self._slab.data_ptr(), self._slab.nbytes, threads=populate_threads())
            t1 = time.perf_counter()
            self.pinned = self._register_pinned()
            self.prepare_secs = {"populate": t1 - t0, "register": time.perf_counter() - t1}
        flat = self._slab.numpy()
        self.buffers: list[torch.Tensor] = []
        for (shape, stride, dtype), off in zip(self.specs, offsets):
            nbytes = span_elems(shape, stride) * dtype.itemsize
            if nbytes == 0:
                self.buffers.append(torch.empty_strided(shape, stride, dtype=dtype))
                continue
            region = torch.frombuffer(flat[off : off + nbytes], dtype=torch.uint8)
            self.buffers.append(region.view(dtype).as_strided(shape, stride))
        self.busy = False

    def _register_pinned(self) -> bool:
        """Page-lock the arena piece by piece, pausing :data:`REGISTER_PAUSE` times as long as each piece
        took after it; False (pageable memory: correct, slower copies) where the driver refuses.

        The driver holds the training thread's CUDA calls while it registers memory; short pieces with
        pauses between them spread that over many steps. The pauses stretch the preparation (20 GB:
        ~4.7 s instead of ~1 s), so a save that has to wait for the arena sets ``hurry`` and the rest
        is registered without them.
        """
        base = self._slab.data_ptr()
        pause = REGISTER_PAUSE
        try:
            for k, (start, stop) in enumerate(self.pieces):
                t0 = time.perf_counter()
                self._register_piece(base + start, stop - start)
                self._registered.append(base + start)
                if pause > 0 and k + 1 < len(self.pieces):
                    self._pause(pause * (time.perf_counter() - t0))
            return True
        except Exception as exc:
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
