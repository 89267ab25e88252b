"""Upload host byte ranges to the GPU on native threads, holding no GIL (``upload_native.c``).

Why: a restore uploads what it read to the GPU: each mapped file whole, for the device checksum
(:mod:`checkpointd.restore.device_image`), or the stored tensors' bytes into the live ones
(:func:`checkpointd.restore.bulkcopy.copy_pairs`, where the files were checksummed on the host). Through the
Python bounce in :mod:`checkpointd.restore.bulkcopy` that is one Python thread whose every 16 MiB chunk
takes and drops the GIL several times, so nothing else in the process may run Python meanwhile without
slowing it: a parse of the other file beside it makes restores slower, and the parses wait for the
uploads. ``cpd_upload`` does a whole upload in one ``ctypes`` call (which releases the GIL): worker
threads take slot-sized pieces of the ranges in turn, copy each into one of their pinned slots and queue
its DMA on their own stream, reusing a slot once its DMA has finished. The pinned slots are the bounce
pool's (the same bytes pinned). H200, 4.83 GB from tmpfs: 49 GB/s against 35 through the Python bounce,
a restore 130 ms against 172.

``pip install`` compiles ``upload_native.c`` (an optional extension of ``setup.py``) and
:mod:`checkpointd.native.loader` loads it; restores use it whenever :func:`library` loads it. Where it is
not built, native code is turned off (:func:`checkpointd.options.native_enabled`), or the CUDA driver
cannot be reached, :func:`library` is None or :func:`upload_pairs` raises :class:`UploadError`, and
callers use the Python bounce.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any, Sequence

import torch

from checkpointd.native import cuda_rtc
from checkpointd.native.loader import NativeLibrary

ABI = 2
"""``cpd_upload_abi()`` of the C source this module expects."""
SLOTS_PER_WORKER = 2
"""A worker copies into one slot while the other's DMA drains."""
MIN_SLOT_BYTES = 64 << 10
"""Smaller slots (a small bounce pool) cost more in calls than they move: the Python bounce copies instead."""

DRIVER_FUNCTIONS = ("cuCtxSetCurrent", "cuStreamCreate", "cuStreamDestroy_v2", "cuStreamWaitEvent",
                    "cuStreamSynchronize", "cuEventCreate", "cuEventDestroy_v2", "cuEventRecord",
                    "cuEventSynchronize", "cuMemcpyHtoDAsync_v2")
"""The fields of ``struct cpd_cuda``, in order."""

FAILED_CALLS = {0: "nowhere", 1: "cuCtxSetCurrent", 2: "cuStreamCreate", 3: "cuEventCreate", 4: "cuStreamWaitEvent",
                5: "cuEventSynchronize (reusing a slot)", 6: "cuMemcpyHtoDAsync", 7: "cuEventRecord",
                8: "cuStreamSynchronize", 9: "starting a thread"}
"""What ``cpd_upload`` reports in ``where`` on a failure: the step that failed."""


class Driver(ctypes.Structure):
    """The CUDA driver's entry points handed to ``cpd_upload`` (its ``struct cpd_cuda``)."""

    _fields_ = [(name, ctypes.c_void_p) for name in DRIVER_FUNCTIONS]


class UploadError(RuntimeError):
    """The native upload failed (the caller falls back to a path that needs none of it)."""


def declare(lib: Any) -> None:
    """Declare the ctypes signature of ``cpd_upload``."""
    lib.cpd_upload.restype = ctypes.c_int
    lib.cpd_upload.argtypes = [ctypes.POINTER(Driver), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                               ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                               ctypes.POINTER(ctypes.c_int)]


LIBRARY = NativeLibrary("upload_native", ("cpd_upload_abi", ABI), declare, "native upload",
                        "restores upload through the Python bounce")
"""The built ``upload_native.c``."""

library = LIBRARY.get
"""The loaded library, or None (callers use the Python bounce); loaded on the first call."""
reset = LIBRARY.reset
"""Forget the loaded state so the next :func:`library` call decides again (tests)."""


__getattr__ = LIBRARY.module_getattr(__name__)
"""``why_not``: why the native upload is not in use ("" when it is, or before the first try)."""


def upload(lib: Any, driver: Driver, ctx: int, ranges: Sequence[tuple[int, int, int]], slots: Sequence[int],
           slot_bytes: int, workers: int, after_event: int | None) -> None:
    """Copy each ``(device address, host address, length)`` of ``ranges`` (finished on return).

    ``slots``: ``workers x SLOTS_PER_WORKER`` pinned buffers of ``slot_bytes``, used by nothing else during
    the call; ``after_event``: a CUDA event the copies wait for first (work queued on the destinations).
    Raises :class:`UploadError` naming the driver call that failed.
    """
    if len(slots) < workers * SLOTS_PER_WORKER:
        raise ValueError(f"{len(slots)} slots for {workers} workers: need {workers * SLOTS_PER_WORKER}")
    n = len(ranges)
    dsts = (ctypes.c_uint64 * n)(*[r[0] for r in ranges])
    srcs = (ctypes.c_void_p * n)(*[r[1] for r in ranges])
    lens = (ctypes.c_int64 * n)(*[r[2] for r in ranges])
    table = (ctypes.c_void_p * len(slots))(*slots)
    where = ctypes.c_int(0)
    rc = lib.cpd_upload(ctypes.byref(driver), ctypes.c_void_p(ctx), dsts, srcs, lens, n, table, slot_bytes,
                        workers, SLOTS_PER_WORKER, ctypes.c_void_p(after_event or 0), ctypes.byref(where))
    if rc != 0:
        total = sum(r[2] for r in ranges)
        raise UploadError(f"native upload of {total} bytes in {n} ranges failed in "
                          f"{FAILED_CALLS.get(where.value, where.value)} (error {rc})")


@functools.lru_cache(maxsize=1)
def cuda_driver() -> Driver:
    """The real driver's entry points (:mod:`checkpointd.native.cuda_rtc` loads ``libcuda``), looked up once."""
    return Driver(*cuda_rtc.driver_functions(DRIVER_FUNCTIONS))


def upload_pairs(items: Sequence[tuple[torch.Tensor, torch.Tensor]], pinned: Sequence[torch.Tensor], workers: int) -> None:
    """``dst.copy_(src)`` for every ``(dst, src)`` of ``items``: CUDA ``dst`` (all on one device), CPU ``src``,
    both 1-D uint8 of one size, through ``pinned`` (the chunks cut into ``workers x SLOTS_PER_WORKER`` equal
    slots: 2 MiB for the default 4 x 16 MiB and 16 workers); finished on return. Raises
    :class:`UploadError` where that cannot run (the caller copies another way)."""
    lib = library()
    if lib is None:
        raise UploadError(f"native upload unavailable: {LIBRARY.why_not}")
    if not items:
        return
    device = items[0][0].device
    for dst, src in items:
        if (dst.device != device or src.device.type != "cpu" or dst.numel() != src.numel() or dst.dtype != torch.uint8
                or src.dtype != torch.uint8 or not (dst.is_contiguous() and src.is_contiguous())):
            raise ValueError("upload_pairs copies contiguous CPU uint8 buffers into CUDA ones of the same size on one device")
    per_chunk = -(-workers * SLOTS_PER_WORKER // len(pinned)) if pinned else 0
    slot_bytes = min(p.numel() for p in pinned) // per_chunk if pinned else 0
    if slot_bytes < MIN_SLOT_BYTES:
        raise UploadError(f"{len(pinned)} pinned chunks are too small for {workers} workers' slots")
    slots = [p.data_ptr() + k * slot_bytes for p in pinned for k in range(per_chunk)][:workers * SLOTS_PER_WORKER]
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        driver, ctx = cuda_driver(), cuda_rtc.primary_context(index)
    except cuda_rtc.KernelUnavailable as exc:  # no libcuda entry point or context: the caller's other path
        raise UploadError(f"native upload cannot reach the CUDA driver: {exc}") from exc
    after = torch.cuda.Event()
    after.record(torch.cuda.current_stream(device))  # what the caller queued on the destinations comes first
    upload(lib, driver, ctx, [(d.data_ptr(), s.data_ptr(), d.numel()) for d, s in items], slots, slot_bytes, workers,
           after.cuda_event)


__all__ = ["ABI", "Driver", "LIBRARY", "UploadError", "library", "reset", "upload", "upload_pairs"]
