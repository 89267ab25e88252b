"""Shared-memory slabs for staging buffers, so the persist process can read the staged bytes.

Why: the staged tensors of a save are written to their files by a separate process
(:mod:`checkpointd.storage.persist_process`), so that neither the writing threads' Python nor their page faults
share the training process's GIL and memory-map lock. That process needs the bytes without a copy: a
staging arena is therefore allocated as a ``memfd`` (anonymous shared memory, not limited by the size
of ``/dev/shm``), mapped here, page-locked like private staging memory (``cudaHostRegister`` works on any mapping), and
mapped once more by the persist process from the descriptor it is sent.

A process-wide registry maps addresses to slabs, so a byte range the writer holds (a ``memoryview`` of
a staged tensor) can be named to the other process as ``(slab id, offset, length)``.
"""

from __future__ import annotations

import bisect
import itertools
import mmap
import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from checkpointd import options
from checkpointd.native.planes import address
from checkpointd.storage import pagemem

_ids = itertools.count(1)
_lock = threading.Lock()
_starts: list[int] = []
_slabs: list["SharedSlab"] = []
_release_listeners: list[Callable[[int], None]] = []


def supported() -> bool:
    """Shared staging needs ``memfd_create`` (Linux) and is on unless the environment turns it off
    (:func:`checkpointd.options.persist_process_enabled`)."""
    if not options.persist_process_enabled():
        return False
    return hasattr(os, "memfd_create") and hasattr(os, "register_at_fork")


def on_release(listener: Callable[[int], None]) -> None:
    """Call ``listener(slab_id)`` whenever a slab is released (the persist process then unmaps it).

    Why a listener and not a call: this module is below the persist process's client
    (:mod:`checkpointd.storage.persist_process`), which registers itself here when it is imported."""
    if listener not in _release_listeners:
        _release_listeners.append(listener)


class SharedSlab:
    """``nbytes`` of shared memory: a ``memfd`` descriptor (kept for the persist process) and its mapping."""

    def __init__(self, nbytes: int) -> None:
        self.id = next(_ids)
        self.nbytes = nbytes
        self.fd: int | None = os.memfd_create(f"checkpointd-staging-{self.id}", getattr(os, "MFD_CLOEXEC", 1))
        try:
            os.ftruncate(self.fd, nbytes)
            # released in pieces when the last view dies (an arena replaced during training: pagemem)
            self.mapping = pagemem.PiecewiseReleasedMap(self.fd, nbytes, flags=mmap.MAP_SHARED,
                                                        prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        self.array = np.frombuffer(self.mapping, dtype=np.uint8)
        self.address = int(self.array.ctypes.data)
        with _lock:
            i = bisect.bisect(_starts, self.address)
            _starts.insert(i, self.address)
            _slabs.insert(i, self)

    def release(self) -> None:
        """Forget the slab (the :func:`on_release` listeners are told: the persist process unmaps it) and
        close its descriptor.

        The mapping itself goes when the last tensor viewing it does.
        """
        with _lock:
            if self in _slabs:
                i = _slabs.index(self)
                del _starts[i], _slabs[i]
        if self.fd is not None:
            for listener in list(_release_listeners):
                listener(self.id)
            os.close(self.fd)
            self.fd = None


def locate(view: Any) -> tuple[SharedSlab, int] | None:
    """``(slab, offset)`` of the bytes ``view`` (a buffer) spans, when they lie in one live slab."""
    mv = memoryview(view)
    if mv.nbytes == 0 or not mv.c_contiguous:
        return None
    start = address(mv.cast("B"))
    with _lock:
        i = bisect.bisect(_starts, start) - 1
        if i < 0:
            return None
        slab = _slabs[i]
    offset = start - slab.address
    if offset + mv.nbytes > slab.nbytes or slab.fd is None:
        return None
    return slab, offset


__all__ = ["SharedSlab", "locate", "on_release", "supported"]
