"""CUDA paths: pinned reused staging buffers, side-stream copies, the waits before the optimizer step
and the next forward, GradScaler on CUDA, and a bit-exact CUDA resume.

Skipped where CUDA is unavailable (CI); run on a GPU host with ``python -m pytest tests/gpu -q``.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from checkpointd import CheckpointManager, StagingOptions, load
from cuda_models import big_model as _big_model, run_scaled, scaled_cnn, train_step as _train_step

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_pinned_buffers_reused_without_new_allocations(tmp_path):
    model = _big_model(2048, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    _train_step(model, opt)  # optimizer state exists now; the post-step hook prepares buffers in the background
    mgr = CheckpointManager(tmp_path, {"model": model, "opt": opt}, compression=None)
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    state_bytes += sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
    mgr.save(1)
    mgr.wait()
    s1 = mgr.stats()
    assert s1["pinned_bytes"] > 0, "staging buffers must be page-locked on CUDA"
    assert s1["pinned_bytes"] <= 1.05 * state_bytes + (1 << 20), (s1["pinned_bytes"], state_bytes)
    allocations = s1["staging_allocations"]
    for step in range(2, 6):
        _train_step(model, opt)
        mgr.save(step)
    mgr.wait()
    assert mgr.stats()["staging_allocations"] == allocations, "no new staging allocation after the first save"
    mgr.close()


def test_maybe_save_returns_before_copies_finish_and_optimizer_waits(tmp_path):
    model = _big_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    _train_step(model, opt)
    mgr = CheckpointManager(tmp_path, {"model": model, "opt": opt}, compression=None)
    mgr.save(1)
    mgr.wait()  # buffers exist now
    expected = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    expected_m = {i: opt.state[p]["exp_avg"].cpu().clone() for i, p in enumerate(model.parameters()) if p in opt.state}
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    assert mgr.maybe_save(2, force=True)
    end.record()
    # Copies are queued lazily (at the next forward/optimizer step) and then run on a side stream:
    # right after maybe_save they are either not queued yet or still running.
    in_flight = any(not c.enqueued.is_set() or (c.all_done is not None and not c.all_done.query())
                    for c in mgr._snap._inflight)
    # The very next thing the loop does modifies every snapshotted tensor: forward (BatchNorm stats) and step.
    _train_step(model, opt)
    mgr.wait()
    saved = load(tmp_path, step=2)
    for k, v in expected.items():
        assert torch.equal(saved["model"][k], v), f"{k} leaked a later update into the checkpoint"
    for i, m in expected_m.items():
        assert torch.equal(saved["opt"]["state"][i]["exp_avg"], m)
    assert in_flight, "copies of ~1.5 GB should still be in flight when maybe_save returns (side stream)"
    mgr.close()


@pytest.mark.parametrize("device_staging", [False, True])
def test_forward_waits_only_for_buffers(tmp_path, device_staging):
    """The next forward updates BatchNorm statistics in place: it waits for their copy (device staging:
    their clone on the side stream) and the checkpoint keeps the values of the save point."""
    model = _big_model(2048, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kw = {"staging": StagingOptions(device_budget_bytes=8 << 30)} if device_staging else {}
    mgr = CheckpointManager(tmp_path, {"model": model, "opt": opt}, compression=None, **kw)
    model.train()
    before = model[0].running_mean.detach().cpu().clone()
    mgr.save(1)
    model(torch.randn(64, 2048, device="cuda") + 5)  # changes running_mean in place
    mgr.wait()
    assert torch.equal(load(tmp_path)["model"]["0.running_mean"], before)
    assert not torch.equal(model[0].running_mean.cpu(), before)
    mgr.close()


def test_grad_scaler_on_cuda_and_bit_exact_resume(tmp_path):
    def make():
        return scaled_cnn(8, 8, 0)

    def run(m, o, sc, steps, gen):
        run_scaled(m, o, sc, steps, gen, 8)

    m1, o1, s1 = make()
    g = torch.Generator(device="cuda").manual_seed(1)
    run(m1, o1, s1, 10, g)
    mgr = CheckpointManager(tmp_path, {"model": m1, "opt": o1, "scaler": s1, "gen": {"g": g.get_state()}}, compression="zstd")
    mgr.save(10)
    mgr.wait()
    gstate = g.get_state()
    scale_at_10 = s1.get_scale()
    run(m1, o1, s1, 10, g)
    final_ref = copy.deepcopy(m1.state_dict())
    mgr.close()

    m2, o2, s2 = make()
    gen_box: dict = {"g": None}
    mgr2 = CheckpointManager(tmp_path, {"model": m2, "opt": o2, "scaler": s2, "gen": gen_box}, compression="zstd")
    assert mgr2.restore_latest() == 10
    assert torch.equal(gen_box["g"], gstate)
    assert s2.get_scale() == scale_at_10
    w = m2[0].weight
    assert w.is_contiguous(memory_format=torch.channels_last)
    assert o2.state[w]["exp_avg"].is_contiguous(memory_format=torch.channels_last)
    g2 = torch.Generator(device="cuda")
    g2.set_state(gen_box["g"])
    run(m2, o2, s2, 10, g2)
    for k, v in final_ref.items():
        assert torch.equal(m2.state_dict()[k], v), k
    mgr2.close()


def test_device_staging_isolates_snapshot_without_waiting(tmp_path):
    model = _big_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    _train_step(model, opt)
    mgr = CheckpointManager(tmp_path, {"model": model, "opt": opt}, compression=None,
                            staging=StagingOptions(device_budget_bytes=8 << 30))
    mgr.save(1)
    mgr.wait()
    expected = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    mgr.save(2)
    _train_step(model, opt)  # modifies every tensor right away; the GPU clone keeps the snapshot exact
    _train_step(model, opt)
    mgr.wait()
    saved = load(tmp_path, step=2)
    for k, v in expected.items():
        assert torch.equal(saved["model"][k], v), k
    mgr.close()


def test_device_staging_clones_off_the_compute_stream(tmp_path):
    """The clone runs on the side stream, queued at the next forward: the compute stream carries
    nothing between events recorded around ``maybe_save`` (far less than the clone would take there). A second
    save while the first one's device-to-host copies are still queued clones into the same GPU buffers
    only after them: both stay exact although training modifies every tensor right after each save."""
    model = _big_model(4096, 12)  # ~0.8 GB of parameters, ~2.4 GB with AdamW state
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    _train_step(model, opt)
    mgr = CheckpointManager(tmp_path, {"model": model, "opt": opt}, compression=None, max_pending=2,
                            staging=StagingOptions(device_budget_bytes=16 << 30))
    mgr.save(1)
    mgr.wait()
    buffers = mgr._snap.device_arena.current
    scratch = [torch.empty_like(b) for b in buffers]
    timed = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    torch.cuda.synchronize()
    timed[0].record()
    torch._foreach_copy_(scratch, buffers)  # the clone, timed alone on the compute stream
    timed[1].record()
    torch.cuda.synchronize()
    del scratch
    first_param = next(iter(model.parameters()))

    def values() -> tuple[dict, torch.Tensor]:
        return ({k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
                opt.state[first_param]["exp_avg"].cpu().clone())

    expected = {2: values()}
    torch.cuda._sleep(400_000_000)  # keeps the GPU busy (~0.2 s) past the call: both events and what the
    timed[2].record()  # call queues between them on the compute stream run back to back afterwards
    mgr.save(2)
    timed[3].record()
    clone = mgr._snap._inflight[-1].clone
    assert clone is not None and clone.done is None, "queued at the next forward, not in maybe_save"
    _train_step(model, opt)  # queues the clone, waits for it on the GPU; save 2's copies only partly queued
    assert clone.waited_all and clone.done is not None
    expected[3] = values()
    mgr.save(3)
    _train_step(model, opt)
    _train_step(model, opt)
    mgr.wait()
    for step, (exp, exp_avg) in expected.items():
        saved = load(tmp_path, step=step)
        for key, v in exp.items():
            assert torch.equal(saved["model"][key], v), (step, key)
        assert torch.equal(saved["opt"]["state"][0]["exp_avg"], exp_avg), step
    mgr.close()
    clone_ms, around = timed[0].elapsed_time(timed[1]), timed[2].elapsed_time(timed[3])
    assert around < 0.25 * clone_ms, f"compute stream around maybe_save: {around} ms; a clone on it: {clone_ms} ms"


def test_persist_process_writes_pinned_shared_staging_bit_exact(tmp_path):
    """CUDA staging arenas live in shared memory, page-locked, and the persist process writes them."""
    from checkpointd.storage import persist_process
    from checkpointd.storage import sharedmem

    if not sharedmem.supported():
        pytest.skip("shared staging needs Linux memfd_create")
    model = _big_model(1024, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    _train_step(model, opt)
    with CheckpointManager(tmp_path, {"model": model, "opt": opt}, compression=None) as mgr:
        mgr.save(1)
        mgr.wait()
        process = persist_process.client()
        assert process is not None and process.alive
        done = process.writes_done
        expected = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        mgr.save(2)
        _train_step(model, opt)  # modifies everything right after the save point
        mgr.wait()
        assert process.writes_done >= done + 2
        assert mgr.stats()["pinned_bytes"] > 0
    restored = load(tmp_path, step=2)["model"]
    for k, v in expected.items():
        assert torch.equal(restored[k], v), k


def test_device_clone_warm_up_touches_no_staging_buffer():
    """The warm-up launch (one element per dtype, channels_last included) runs and leaves the buffers as they were."""
    from checkpointd.save.device_copies import warm_device_clone

    dev = torch.device("cuda")
    buffers = [
        torch.randn(8, 3, 5, 5, device=dev).to(memory_format=torch.channels_last),
        torch.randn(17, device=dev).to(torch.bfloat16),
        torch.arange(5, device=dev),
        torch.empty(0, device=dev),
    ]
    before = [b.clone() for b in buffers]
    warm_device_clone(buffers)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) and a.stride() == b.stride() for a, b in zip(buffers, before))


@pytest.mark.parametrize("device_staging,width", [(False, 4096), (True, 4096), (True, 512)])
def test_planning_waits_for_the_next_optimizer_step(tmp_path, monkeypatch, device_staging, width):
    """A large snapshot's files are pickled once the training thread reached its next optimizer step (it
    then waits for the GPU, holding no GIL), not during the save step and the forward after it; with no
    step, after ``PLAN_WAIT_SECS``. The files stay bit-exact. (Width 512 is a small state, copied in one
    paced batch at the forward's hook, made "large" here so its deferral is exercised too.)"""
    import time

    from checkpointd.save import device_copies
    from checkpointd.save import writer as writer_mod

    monkeypatch.setattr(device_copies, "PLAN_DEFER_MIN_BYTES", 0)

    planned_at: list[float] = []
    orig_plan_job = writer_mod.BackgroundWriter.plan_job

    def plan_job(self, job):
        orig_plan_job(self, job)
        planned_at.append(time.perf_counter())

    monkeypatch.setattr(writer_mod.BackgroundWriter, "plan_job", plan_job)
    model = _big_model(width)  # 512: copied in one paced batch, at the forward's hook
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    _train_step(model, opt)
    kw = {"staging": StagingOptions(device_budget_bytes=8 << 30)} if device_staging else {}
    mgr = CheckpointManager(tmp_path, {"model": model, "opt": opt}, compression=None, **kw)
    mgr.save(1)
    mgr.wait()
    assert len(planned_at) == 1
    expected = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}

    mgr.save(2)
    model(torch.randn(64, model[0].num_features, device="cuda")).square().mean().backward()  # no planning yet
    time.sleep(0.3)
    assert len(planned_at) == 1, "planned before the training thread reached its optimizer step"
    t_step = time.perf_counter()
    opt.step()
    opt.zero_grad(set_to_none=True)
    deadline = time.monotonic() + 1.5  # well before PLAN_WAIT_SECS: the step's hook, not the timeout
    while len(planned_at) < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert len(planned_at) == 2 and planned_at[1] >= t_step, "the optimizer step's hook must let planning start"
    mgr.wait()
    # The committer's clock starts when it takes the job, which the training thread's forward and
    # backward (holding the GIL) may delay by a few ms past the start of the 0.3 s sleep.
    assert 0.25 <= mgr.stats()["last_save"]["plan_wait_secs"] < writer_mod.PLAN_WAIT_SECS

    monkeypatch.setattr(writer_mod, "PLAN_WAIT_SECS", 0.2)
    t_save = time.perf_counter()
    mgr.save(3)  # no optimizer step follows: planning starts after PLAN_WAIT_SECS
    deadline = time.monotonic() + 10
    while len(planned_at) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(planned_at) == 3 and planned_at[2] - t_save >= 0.2
    mgr.wait()
    mgr.close()
    got = load(str(tmp_path), 2)["model"]
    for k, v in expected.items():
        assert torch.equal(got[k], v), k


def test_small_snapshots_plan_at_once(tmp_path, monkeypatch):
    """Below ``PLAN_DEFER_MIN_BYTES`` the committer plans without waiting for the optimizer step."""
    import time

    from checkpointd.save import writer as writer_mod

    planned = threading.Event()
    orig_plan_job = writer_mod.BackgroundWriter.plan_job

    def plan_job(self, job):
        orig_plan_job(self, job)
        planned.set()

    monkeypatch.setattr(writer_mod.BackgroundWriter, "plan_job", plan_job)
    model = _big_model(512)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    _train_step(model, opt)
    with CheckpointManager(tmp_path, {"model": model, "opt": opt}, compression=None) as mgr:
        mgr.save(1)
        mgr.wait()
        planned.clear()
        t0 = time.perf_counter()
        mgr.save(2)
        assert planned.wait(1.0), "a small snapshot must not wait for the optimizer step to plan"
        assert time.perf_counter() - t0 < 1.0
        _train_step(model, opt)
        mgr.wait()
        assert "plan_wait_secs" not in mgr.stats()["last_save"]


@pytest.mark.parametrize("shared", [True, False])
def test_arena_page_locked_in_pieces_copies_async_and_bit_exact(monkeypatch, shared):
    """Every buffer of an arena registered in many pieces is pinned memory to CUDA (an asynchronous
    device-to-host copy lands in it), none crosses a piece, and the copies are bit-exact."""
    from checkpointd.save import arena as arena_mod
    from checkpointd.save.arena import StagingArena, tensor_spec
    from checkpointd.storage import sharedmem

    if shared and not sharedmem.supported():
        pytest.skip("no shared staging memory here")
    monkeypatch.setattr(arena_mod, "REGISTER_PIECE_BYTES", 1 << 20)
    g = torch.Generator(device="cuda").manual_seed(3)
    sources = [torch.randn(n, device="cuda", generator=g) for n in (3, 70_000, 300_000, 1000, 600_000, 5)]
    sources.append(torch.randn(8, 16, 9, 9, device="cuda", generator=g).to(memory_format=torch.channels_last))
    arena = StagingArena([tensor_spec(t) for t in sources], pin=True, shared=shared)
    try:
        assert arena.pinned and len(arena.pieces) >= 3, arena.pieces
        base = arena.buffers[0].data_ptr()
        for buf in arena.buffers:
            start = buf.data_ptr() - base
            assert buf.is_pinned(), "a buffer in a registered piece must be pinned to CUDA"
            assert any(a <= start and start + buf.untyped_storage().nbytes() <= b for a, b in arena.pieces)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for src, dst in zip(sources, arena.buffers):
                dst.copy_(src, non_blocking=True)
        side.synchronize()
        for src, dst in zip(sources, arena.buffers):
            assert dst.stride() == src.stride()
            assert torch.equal(dst, src.cpu())
    finally:
        arena.release()
    assert arena._registered == []


def test_a_save_waiting_for_its_arena_ends_the_registration_pauses(tmp_path, monkeypatch):
    """The arena is page-locked piece by piece with pauses (so the training's CUDA calls are held only
    briefly); a save that needs it before it is ready sets ``hurry``: the pause under way ends and the
    rest is registered without pauses, with the real ``cudaHostRegister``."""
    import time

    from checkpointd.save import arena as arena_mod
    from checkpointd.save.arena import StagingArena

    monkeypatch.setattr(arena_mod, "REGISTER_PIECE_BYTES", 64 << 20)
    monkeypatch.setattr(arena_mod, "REGISTER_PAUSE", 300.0)  # each pause 300x its piece's registration
    pauses: list[tuple[float, float, bool]] = []  # (asked, took, hurried before it began)
    paused = threading.Event()
    real_pause = StagingArena._pause

    def pause(self, secs):
        hurried = self._hurry is not None and self._hurry.is_set()
        paused.set()
        t0 = time.perf_counter()
        real_pause(self, secs)
        pauses.append((secs, time.perf_counter() - t0, hurried))

    monkeypatch.setattr(StagingArena, "_pause", pause)
    model = _big_model()  # 1.6 GB with AdamW's state: 25 pieces
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    _train_step(model, opt)
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    state_bytes += sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
    mgr = CheckpointManager(tmp_path, {"model": model, "opt": opt}, compression=None)
    _train_step(model, opt)  # its post-step hook starts preparing the arena in the background
    assert paused.wait(60), "the arena's registration never paused"
    assert mgr._snap._preparing, "the arena must still be in preparation when the save comes"
    expected = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    mgr.save(1)
    mgr.wait()
    stats = mgr.stats()
    assert stats["pinned_bytes"] >= state_bytes
    assert stats["staging_arena_wait_secs"] > 0  # the save did wait for it
    assert len(pauses) == stats["staging_prepare_secs"]["pieces"] - 1 >= 20
    later = [p for p in pauses if p[2]]
    assert later and all(took < 0.005 for _, took, _ in later), later  # pauses after the save came: none
    asked = sum(a for a, _, _ in later)
    assert stats["staging_arena_wait_secs"] < asked, (stats["staging_arena_wait_secs"], asked)  # what hurry saved
    mgr.close()
    saved = load(tmp_path, step=1)["model"]
    for k, v in expected.items():
        assert torch.equal(saved[k], v), k
