"""Staging arenas page-locked in pieces (``arena.arena_layout``, ``StagingArena._register_pinned``).

The registration itself needs CUDA (``tests/gpu/test_cuda_paths.py`` checks that every buffer of a
many-piece arena is pinned and copied into bit-exactly); here the layout, the order and addresses of
the registration calls, the pauses, ``hurry`` and the fallback are checked with the driver call replaced.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

from checkpointd.storage import sharedmem
from checkpointd.save import arena as arena_mod
from checkpointd.save import snapshot
from checkpointd.save.arena import PAGE_BYTES, StagingArena, arena_layout, tensor_spec

MiB = 1 << 20
SPECS = [tensor_spec(torch.empty(n, dtype=torch.float32, device="meta")) for n in
         (3, 300_000, 70_000, 1_000_000, 5, 262_144, 400_000, 1)]
SPECS.append(tensor_spec(torch.empty(2, 3, 5, 7, device="meta").to(memory_format=torch.channels_last)))


def _sizes(specs):
    return [arena_mod.span_elems(sh, st) * dt.itemsize for sh, st, dt in specs]


@pytest.mark.parametrize("piece", [0, MiB, 2 * MiB, 64 * MiB])
def test_layout_pieces_start_on_pages_and_hold_whole_buffers(piece):
    offsets, total, pieces = arena_layout(SPECS, piece)
    sizes = _sizes(SPECS)
    assert pieces[0][0] == 0 and pieces[-1][1] == total
    for (a, b), (c, d) in zip(pieces, pieces[1:]):
        assert b == c and c % PAGE_BYTES == 0, "pieces are adjacent, and each starts on a page"
    for off, n in zip(offsets, sizes):
        assert off % arena_mod.ALIGN_BYTES == 0
        inside = [(a, b) for a, b in pieces if a <= off and off + n <= b]
        assert len(inside) == 1, f"a buffer at {off} of {n} bytes must lie in exactly one piece: {pieces}"
    for (a, b) in pieces:
        held = [n for off, n in zip(offsets, sizes) if a <= off < b]
        assert b - a <= max(piece, max(held) + PAGE_BYTES) or piece == 0
    if piece == 0:
        assert pieces == [(0, total)]
    if piece == MiB:
        assert len(pieces) >= 4  # 4 MB of buffers in 1 MiB pieces (the 4 MB one alone)


def test_layout_without_pieces_is_the_packed_layout():
    offsets, total, _ = arena_layout(SPECS, 0)
    expect, at = [], 0
    for n in _sizes(SPECS):
        expect.append(at)
        at += -(-n // arena_mod.ALIGN_BYTES) * arena_mod.ALIGN_BYTES
    assert offsets == expect and total == at
    _, total_pieces, _ = arena_layout(SPECS, MiB)
    assert total <= total_pieces <= total + len(SPECS) * PAGE_BYTES, "pieces cost at most a page each"


class _Recorder:
    def __init__(self, delay: float = 0.0, fail_at: int | None = None):
        self.calls: list[tuple[int, int]] = []
        self.delay, self.fail_at = delay, fail_at

    def __call__(self, ptr: int, nbytes: int) -> None:
        if self.fail_at is not None and len(self.calls) == self.fail_at:
            raise RuntimeError("cudaHostRegister returned 2")
        self.calls.append((ptr, nbytes))
        if self.delay:
            time.sleep(self.delay)


@pytest.mark.parametrize("shared", [False, True])
def test_registration_goes_piece_by_piece_on_page_aligned_addresses(monkeypatch, shared):
    if shared and not sharedmem.supported():
        pytest.skip("no shared staging memory here")
    monkeypatch.setattr(arena_mod, "REGISTER_PIECE_BYTES", MiB)
    monkeypatch.setattr(arena_mod, "REGISTER_PAUSE", 0.0)
    rec = _Recorder()
    monkeypatch.setattr(StagingArena, "_register_piece", staticmethod(rec))
    arena = StagingArena(SPECS, pin=True, shared=shared)
    try:
        assert arena.pinned
        base = arena._slab.data_ptr()
        assert base % PAGE_BYTES == 0
        assert rec.calls == [(base + a, b - a) for a, b in arena.pieces]
        assert len(rec.calls) >= 4 and set(arena.prepare_secs) == {"populate", "register"}
        for buf, spec in zip(arena.buffers, SPECS):  # the buffers still follow the layout, strides included
            assert tensor_spec(buf) == spec
            buf.fill_(1)
        assert arena.buffers[-1].is_contiguous(memory_format=torch.channels_last)
    finally:
        monkeypatch.setattr(StagingArena, "_unregister", lambda self: setattr(self, "_registered", []))
        arena.release()


def test_pauses_follow_each_piece_and_hurry_skips_them(monkeypatch):
    monkeypatch.setattr(arena_mod, "REGISTER_PIECE_BYTES", MiB)
    monkeypatch.setattr(arena_mod, "REGISTER_PAUSE", 3.0)
    monkeypatch.setattr(StagingArena, "_unregister", lambda self: setattr(self, "_registered", []))
    rec = _Recorder(delay=0.02)
    monkeypatch.setattr(StagingArena, "_register_piece", staticmethod(rec))
    waits: list[float] = []

    class Hurry(threading.Event):
        def wait(self, timeout=None):
            waits.append(timeout)
            return super().wait(timeout)

    slow = StagingArena(SPECS, pin=True, shared=False, hurry=Hurry())
    n = len(slow.pieces)
    assert len(waits) == n - 1, "a pause after every piece but the last"
    assert all(w >= 3 * 0.02 for w in waits), waits
    assert slow.prepare_secs["register"] >= n * 0.02 + (n - 1) * 0.06
    hurry = Hurry()
    hurry.set()
    waits.clear()
    t0 = time.perf_counter()
    StagingArena(SPECS, pin=True, shared=False, hurry=hurry)
    took = time.perf_counter() - t0
    assert len(waits) == n - 1 and took < n * 0.02 + (n - 1) * 0.06, "hurry: the pauses end at once"


def test_a_failed_piece_unregisters_the_others_and_falls_back(monkeypatch, caplog):
    monkeypatch.setattr(arena_mod, "REGISTER_PIECE_BYTES", MiB)
    monkeypatch.setattr(arena_mod, "REGISTER_PAUSE", 0.0)
    rec = _Recorder(fail_at=2)
    monkeypatch.setattr(StagingArena, "_register_piece", staticmethod(rec))
    undone: list[list[int]] = []
    monkeypatch.setattr(StagingArena, "_unregister", lambda self: (undone.append(list(self._registered)), setattr(self, "_registered", [])))
    with caplog.at_level(logging.WARNING, logger="checkpointd"):
        arena = StagingArena(SPECS, pin=True, shared=False)
    assert not arena.pinned and arena._registered == []
    assert undone[0] == [p for p, _ in rec.calls] and len(undone[0]) == 2, "both registered pieces are undone"
    assert "could not pin" in caplog.text and "pageable" in caplog.text
    arena.buffers[1].fill_(2.0)  # still usable, as plain memory
    assert float(arena.buffers[1].sum()) == 2.0 * 300_000


def test_a_waiting_save_hurries_the_preparation(monkeypatch):
    """A save that needs the arena while it is still being registered skips the remaining pauses."""
    monkeypatch.setattr(arena_mod, "REGISTER_PIECE_BYTES", MiB)
    monkeypatch.setattr(arena_mod, "REGISTER_PAUSE", 50.0)  # 50 x 20 ms a piece: ~1 s per pause unhurried
    monkeypatch.setattr(StagingArena, "_unregister", lambda self: setattr(self, "_registered", []))
    monkeypatch.setattr(StagingArena, "_register_piece", staticmethod(_Recorder(delay=0.02)))
    snap = snapshot.Snapshotter()
    snap.cuda = True  # what the preparation would do on a CUDA host: pin (the driver call replaced above)
    snap.prepare_async(SPECS)
    time.sleep(0.1)  # inside the first pauses
    t0 = time.perf_counter()
    arena = snap._acquire(tuple(SPECS))
    waited = time.perf_counter() - t0
    assert arena.pinned and len(arena._registered) == len(arena.pieces)
    assert waited < 0.5 * len(arena.pieces), f"the save waited {waited:.2f} s: the pauses were not skipped"
    assert snap.arena_wait_secs == pytest.approx(waited, abs=0.05)
    assert snap.last_prepare_secs["pieces"] == len(arena.pieces)
    snap.close()


def test_cpu_only_state_is_not_page_locked_on_a_cuda_host(monkeypatch):
    """Pinning buys a CPU tensor's copy nothing and would bring up a CUDA context: on a CUDA host only
    layouts with device tensors are page-locked, ahead of time and at the save alike."""
    monkeypatch.setattr(arena_mod, "REGISTER_PAUSE", 0.0)
    monkeypatch.setattr(StagingArena, "_unregister", lambda self: setattr(self, "_registered", []))
    rec = _Recorder()
    monkeypatch.setattr(StagingArena, "_register_piece", staticmethod(rec))
    snap = snapshot.Snapshotter()
    snap.cuda = True  # a CUDA host (the driver call replaced above)
    tensors = [torch.randn(300_000), torch.arange(1000)]
    specs = [tensor_spec(t) for t in tensors]
    snap.prepare_async(specs, None, [False, False])
    staged = snap.snapshot(tensors)
    assert staged.arena is not None and not staged.arena.pinned and rec.calls == []
    assert snap.arena_allocations == 1 and snap.pinned_bytes == 0  # the prepared arena was used
    assert all(torch.equal(a, b) for a, b in zip(staged.staged, tensors))
    snap.release(staged)
    unprepared = snap.snapshot([torch.randn(5000)])  # a new layout, allocated at the save
    assert not unprepared.arena.pinned and rec.calls == [] and snap.arena_allocations == 2
    snap.release(unprepared)
    other = [torch.randn(1000)]
    snap.prepare_async([tensor_spec(other[0])], None, [True])  # a layout with a device tensor: pinned
    deadline = time.monotonic() + 10
    while snap.arena_allocations < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert snap.arena_allocations == 3 and rec.calls and snap.pinned_bytes > 0
    snap.close()


def test_populate_threads_share_the_cores_between_local_ranks(monkeypatch):
    monkeypatch.setattr(arena_mod.os, "cpu_count", lambda: 16)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert arena_mod.populate_threads() == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert arena_mod.populate_threads() == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert arena_mod.populate_threads() == 1
    monkeypatch.setattr(arena_mod, "POPULATE_THREADS", 6)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert arena_mod.populate_threads() == 4


def test_stats_report_the_preparation(tmp_path):
    from checkpointd import CheckpointManager

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = torch.nn.Linear(4, 4).to(device)
    with CheckpointManager(tmp_path, {"model": model}) as mgr:
        mgr.save(1)
        mgr.wait()
        s = mgr.stats()
    assert s["staging_arena_wait_secs"] >= 0.0
    if device == "cuda":  # the arena of a state with device tensors is page-locked
        assert s["staging_prepare_secs"]["pieces"] >= 1 and s["staging_prepare_secs"]["register"] >= 0.0
    else:
        assert s["staging_prepare_secs"] == {}, "nothing is page-locked for a CPU state"
