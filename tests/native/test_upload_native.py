"""The native upload (``upload_native.c``) on the CPU, against a fake CUDA driver that defers its copies.

The fake driver queues each "DMA" on its stream and performs it only when an event recorded after it is
synchronised (or the stream is): a slot overwritten before its DMA was waited for ships the wrong bytes,
so the bytes on arrival check the slot protocol, not only the chunking. A failing driver call must come
back as an error naming the call, with every thread joined. The GPU run (the real driver, a mapped file)
is ``tests/gpu/test_device_verify_cuda.py::test_native_upload_equals_the_source``.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from checkpointd.restore import bounce
from checkpointd import options
from checkpointd.native import cuda_rtc, loader
from checkpointd.native import upload as upload_native

VP = ctypes.c_void_p
PVP = ctypes.POINTER(ctypes.c_void_p)


@pytest.fixture
def lib():
    loaded = upload_native.library()
    if loaded is None:
        if os.environ.get("CI"):
            pytest.fail(f"native upload unavailable in CI: {upload_native.why_not}", pytrace=False)
        pytest.skip(f"native upload unavailable: {upload_native.why_not}")
    return loaded


class FakeDriver:
    """Streams as queues of deferred copies; events as positions in a stream's queue."""

    def __init__(self, fail_copy_at: int | None = None) -> None:
        self.lock = threading.Lock()
        self.handles = 0
        self.queues: dict[int, list[tuple[int, bytes | None, int, int]]] = {}
        self.events: dict[int, tuple[int, int]] = {}
        self.done: dict[int, int] = {}
        self.copies = 0
        self.fail_copy_at = fail_copy_at
        self.contexts: set[int] = set()
        self.live_streams: set[int] = set()
        self.live_events: set[int] = set()
        ftype = ctypes.CFUNCTYPE
        self._keep = [
            ftype(ctypes.c_int, VP)(self.ctx_set_current),
            ftype(ctypes.c_int, PVP, ctypes.c_uint)(self.stream_create),
            ftype(ctypes.c_int, VP)(self.stream_destroy),
            ftype(ctypes.c_int, VP, VP, ctypes.c_uint)(self.stream_wait_event),
            ftype(ctypes.c_int, VP)(self.stream_synchronize),
            ftype(ctypes.c_int, PVP, ctypes.c_uint)(self.event_create),
            ftype(ctypes.c_int, VP)(self.event_destroy),
            ftype(ctypes.c_int, VP, VP)(self.event_record),
            ftype(ctypes.c_int, VP)(self.event_synchronize),
            ftype(ctypes.c_int, ctypes.c_uint64, VP, ctypes.c_size_t, VP)(self.memcpy_htod_async),
        ]
        self.struct = upload_native.Driver(*[ctypes.cast(f, VP).value for f in self._keep])

    def _new(self) -> int:
        with self.lock:
            self.handles += 1
            return 0x1000 + self.handles

    def ctx_set_current(self, ctx):
        self.contexts.add(ctx)
        return 0

    def stream_create(self, out, flags):
        h = self._new()
        self.queues[h] = []
        self.done[h] = 0
        self.live_streams.add(h)
        out[0] = h
        return 0

    def stream_destroy(self, s):
        self.live_streams.discard(s)
        return 0

    def stream_wait_event(self, s, e, flags):
        return 0

    def _run_until(self, s: int, upto: int) -> None:
        while self.done[s] < upto:
            dst, _, src, n = self.queues[s][self.done[s]]
            ctypes.memmove(dst, src, n)  # the "DMA" reads the slot now, not when it was queued
            self.done[s] += 1

    def stream_synchronize(self, s):
        self._run_until(s, len(self.queues[s]))
        return 0

    def event_create(self, out, flags):
        h = self._new()
        self.live_events.add(h)
        out[0] = h
        return 0

    def event_destroy(self, e):
        self.live_events.discard(e)
        return 0

    def event_record(self, e, s):
        self.events[e] = (s, len(self.queues[s]))
        return 0

    def event_synchronize(self, e):
        s, upto = self.events[e]
        self._run_until(s, upto)
        return 0

    def memcpy_htod_async(self, dst, src, n, s):
        with self.lock:
            self.copies += 1
            if self.fail_copy_at is not None and self.copies >= self.fail_copy_at:
                return 700  # CUDA_ERROR_ILLEGAL_ADDRESS
        self.queues[s].append((dst, None, src, n))
        return 0


def _run(lib, driver, n, workers, slot_bytes, seed=0):
    src, dst = _run_ranges(lib, driver, [n], workers, slot_bytes, seed)
    return src[0], dst[0]


def _run_ranges(lib, driver, sizes, workers, slot_bytes, seed=0):
    rng = np.random.default_rng(seed)
    srcs = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    dsts = [np.zeros(n, dtype=np.uint8) for n in sizes]
    slots = [np.zeros(slot_bytes, dtype=np.uint8) for _ in range(workers * upload_native.SLOTS_PER_WORKER)]
    ranges = [(int(d.ctypes.data), int(s.ctypes.data), n) for d, s, n in zip(dsts, srcs, sizes)]
    upload_native.upload(lib, driver.struct, 0xC0, ranges, [int(s.ctypes.data) for s in slots], slot_bytes, workers, None)
    return srcs, dsts


@pytest.mark.parametrize("n,workers,slot", [(1, 1, 4096), (4096 * 7 + 3, 1, 4096), ((5 << 20) + 123, 3, 64 << 10),
                                            ((1 << 20), 8, 1 << 20), (10 * 4096, 16, 4096)])
def test_every_byte_arrives_with_slots_reused_only_after_their_copy(lib, n, workers, slot) -> None:
    driver = FakeDriver()
    src, dst = _run(lib, driver, n, workers, slot, seed=n)
    assert np.array_equal(dst, src)
    assert driver.copies == -(-n // slot)
    assert driver.contexts == {0xC0}  # every worker made the caller's context current
    assert not driver.live_streams and not driver.live_events  # all released


def test_many_ranges_of_every_size_each_arrive_whole(lib) -> None:
    """Tensors of a restore: empty ones, ones smaller than a slot, ones of several slots (ends unaligned)."""
    sizes = [0, 1, 4095, 0, 4096, 4097, 3 * 4096 + 11, 7, 0, 20 * 4096 + 1, 0]
    driver = FakeDriver()
    srcs, dsts = _run_ranges(lib, driver, sizes, 3, 4096, seed=1)
    for n, s, d in zip(sizes, srcs, dsts):
        assert np.array_equal(d, s), n
    assert driver.copies == sum(-(-n // 4096) for n in sizes)  # each range in pieces of its own


def test_a_failing_driver_call_is_named_and_every_thread_stops(lib) -> None:
    driver = FakeDriver(fail_copy_at=5)
    with pytest.raises(upload_native.UploadError, match="cuMemcpyHtoDAsync.*error 700"):
        _run(lib, driver, 64 * 4096, 4, 4096)
    assert not driver.live_streams and not driver.live_events
    assert driver.copies < 5 + 4  # stopped: at most one more attempt per worker after the failure


def test_nothing_to_copy_calls_nothing(lib) -> None:
    driver = FakeDriver()
    _run(lib, driver, 0, 4, 4096)
    assert driver.handles == 0


def test_too_few_slots_is_refused_before_the_call(lib) -> None:
    with pytest.raises(ValueError, match="slots"):
        upload_native.upload(lib, FakeDriver().struct, 0, [(0, 0, 10)], [0, 0, 0], 4096, 2, None)


def _garbage_library(folder) -> None:
    folder.mkdir()
    (folder / f"upload_native{importlib.machinery.EXTENSION_SUFFIXES[0]}").write_bytes(b"not a shared object")


@pytest.mark.parametrize("setting", ["off", "not built", "not a library", "another ABI"])
def test_without_the_library_restores_take_the_python_bounce(setting, tmp_path, monkeypatch) -> None:
    if setting == "another ABI" and loader.built_library(upload_native.LIBRARY.folder, "upload_native") is None:
        pytest.skip("the ABI check needs the library built at install")
    monkeypatch.delenv(options.NATIVE_ENV, raising=False)
    if setting == "off":
        monkeypatch.setenv(options.NATIVE_ENV, "0")
    elif setting == "not built":
        monkeypatch.setattr(upload_native.LIBRARY, "folder", tmp_path)
    elif setting == "not a library":
        _garbage_library(tmp_path / "pkg")
        monkeypatch.setattr(upload_native.LIBRARY, "folder", tmp_path / "pkg")
    else:
        monkeypatch.setattr(upload_native.LIBRARY, "abi", ("cpd_upload_abi", upload_native.ABI + 1))
    upload_native.reset()
    try:
        assert not bounce.uploads_off_gil()
        assert upload_native.library() is None and upload_native.why_not
        with pytest.raises(upload_native.UploadError, match="native upload unavailable"):
            upload_native.upload_pairs([], [], 1)
    finally:
        upload_native.reset()


def test_the_library_built_at_install_is_loaded_from_the_package_folder(lib) -> None:
    built = loader.built_library(upload_native.LIBRARY.folder, "upload_native")
    assert built is not None and lib._name == str(built) and lib.cpd_upload_abi() == upload_native.ABI
    assert built.parent == Path(upload_native.__file__).resolve().parent
    assert bounce.uploads_off_gil()  # restores use it wherever it loads


class _FakeEvent:
    cuda_event = None

    def record(self, stream=None) -> None:
        pass


def _as_if_on_cuda(monkeypatch, driver) -> None:
    """``upload_pairs``' CUDA calls answered on the CPU: the fake driver, a fake context and event."""
    monkeypatch.setattr(upload_native, "cuda_driver", lambda: driver.struct)
    monkeypatch.setattr(cuda_rtc, "primary_context", lambda index: 0xC0)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def test_upload_pairs_cuts_the_pinned_chunks_into_every_workers_slots(lib, monkeypatch) -> None:
    """The Python side of a restore's upload: pairs of every size, slots cut from the pool's chunks."""
    driver = FakeDriver()
    _as_if_on_cuda(monkeypatch, driver)
    g = torch.Generator().manual_seed(3)
    srcs = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in (0, 1, 70_000, 300_000, 5, 1 << 20)]
    dsts = [torch.zeros_like(s) for s in srcs]
    pinned = [torch.zeros(256 << 10, dtype=torch.uint8) for _ in range(4)]  # 4 x 256 KiB: 8 slots of 128 KiB for 4 workers
    upload_native.upload_pairs(list(zip(dsts, srcs)), pinned, workers=4)
    for d, s in zip(dsts, srcs):
        assert torch.equal(d, s)
    assert driver.copies == sum(-(-s.numel() // (128 << 10)) for s in srcs)
    with pytest.raises(upload_native.UploadError, match="too small"):
        upload_native.upload_pairs(list(zip(dsts, srcs)), [torch.zeros(4096, dtype=torch.uint8)] * 4, workers=16)
    with pytest.raises(ValueError, match="contiguous"):
        upload_native.upload_pairs([(dsts[2][::2], srcs[2][::2])], pinned, workers=4)


def test_upload_pairs_without_a_driver_says_so_as_an_upload_error(lib, monkeypatch) -> None:
    """An upload error is what ``bulkcopy`` falls back on; a missing driver entry point must be one."""
    _as_if_on_cuda(monkeypatch, FakeDriver())

    def no_driver():
        raise cuda_rtc.KernelUnavailable("none of libcuda.so.1, libcuda.so could be loaded")

    monkeypatch.setattr(upload_native, "cuda_driver", no_driver)
    src = torch.ones(10, dtype=torch.uint8)
    with pytest.raises(upload_native.UploadError, match="cannot reach the CUDA driver"):
        upload_native.upload_pairs([(torch.zeros_like(src), src)], [torch.zeros(1 << 20, dtype=torch.uint8)] * 4, 2)
