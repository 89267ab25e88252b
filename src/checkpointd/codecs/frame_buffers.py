"""Buffers that encoded chunks are built in, handed out again once nothing references them.

Why: an encoder that allocates each chunk's output fresh touches new pages on every chunk, and page
faults serialise on the process's memory map (the mappings a persist process writes into fault on the
same lock). A buffer comes back when the last reference to the array :meth:`FrameBuffers.take` handed
out is gone (its frame has been written), and waits for the next chunk while any encoder is open
(:meth:`FrameBuffers.open`); when the last one closes, the waiting buffers are freed, so an idle process
keeps none.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import numpy as np

MIN_BYTES = 1 << 20
"""Smaller buffers are allocated fresh each time (the allocator keeps those warm itself)."""
_ROUND = 1 << 20


class FrameBuffers:
    """A pool of uint8 buffers for chunk frames; at most ``keep`` wait unused."""

    def __init__(self, keep: int = 64) -> None:
        self._keep = keep
        self._free: list[np.ndarray] = []
        self._users = 0
        self._lock = threading.RLock()  # a buffer's return can run inside take(), from a garbage collection

    def take(self, nbytes: int) -> np.ndarray:
        """A uint8 array of ``nbytes`` (contents undefined). Its buffer is reused once this array is gone:
        keep it, or views that hold it (``memoryview(array)`` and its slices), for as long as the bytes are
        read. NumPy slices of it do not hold it (their base is the buffer behind it)."""
        if nbytes < MIN_BYTES:
            return np.empty(nbytes, dtype=np.uint8)
        base = None
        with self._lock:
            for i, free in enumerate(self._free):
                if nbytes <= free.nbytes <= 2 * nbytes:
                    base = self._free.pop(i)
                    break
        if base is None:
            base = np.empty(-(-nbytes // _ROUND) * _ROUND, dtype=np.uint8)
        out = base[:nbytes]
        weakref.finalize(out, self._give_back, base)
        return out

    def open(self, owner: Any) -> weakref.finalize:
        """Count an encoder in: buffers wait for reuse while any is open. Call the result to count it out;
        that also happens when ``owner`` is collected without it."""
        with self._lock:
            self._users += 1
        return weakref.finalize(owner, self._close)

    def waiting(self) -> int:
        """Buffers waiting for reuse."""
        with self._lock:
            return len(self._free)

    def _give_back(self, base: np.ndarray) -> None:
        with self._lock:
            if self._users and len(self._free) < self._keep:
                self._free.append(base)

    def _close(self) -> None:
        with self._lock:
            self._users -= 1
            if not self._users:
                self._free.clear()


FRAME_BUFFERS = FrameBuffers()
"""The process's pool, shared by every encoder."""

__all__ = ["FRAME_BUFFERS", "MIN_BYTES", "FrameBuffers"]
