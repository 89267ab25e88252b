"""What keeps the training thread's share of a save small, beyond the copy itself.

- ``gcfreeze``: full garbage collections triggered by a save's objects must not walk the whole heap;
- the writer pickles and lays out the files *before* waiting for the snapshot copies;
- ``ptlayout.run_tasks(lanes=...)``: a file is written by a bounded number of threads.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
import torch

from checkpointd import CheckpointManager, gcfreeze, ptlayout
from checkpointd import load


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


@pytest.fixture
def gc_restored():
    """Start with no manager holding a freeze (earlier tests may leave managers open) and leave the
    collector as the test found it."""
    enabled = gc.isenabled()
    while gcfreeze.holders():
        gcfreeze.release()
    yield
    while gcfreeze.holders():
        gcfreeze.release()
    gc.unfreeze()
    if enabled:
        gc.enable()
    else:
        gc.disable()


def test_manager_freezes_the_heap_until_the_last_manager_closes(tmp_path, gc_restored) -> None:
    gc.unfreeze()
    garbage = _Cycle()
    dead = weakref.ref(garbage)
    del garbage
    m1 = CheckpointManager(str(tmp_path / "a"), {"model": _model()}, every_n_steps=1, compression=None)
    assert dead() is None, "cyclic garbage alive at construction must be collected, not frozen"
    frozen = gc.get_freeze_count()
    assert frozen > 1000, f"the heap was not frozen ({frozen} objects)"
    m2 = CheckpointManager(str(tmp_path / "b"), {"model": _model()}, every_n_steps=1, compression=None)
    assert gcfreeze.holders() == 2
    m1.close()
    assert gc.get_freeze_count() > frozen // 2, "one manager still open: the heap stays frozen"
    m2.close()
    assert gc.get_freeze_count() == 0 and gcfreeze.holders() == 0


def test_freeze_gc_false_and_a_disabled_collector_are_left_alone(tmp_path, gc_restored) -> None:
    gc.unfreeze()
    with CheckpointManager(str(tmp_path / "a"), {"model": _model()}, every_n_steps=1, compression=None,
                           freeze_gc=False):
        assert gc.get_freeze_count() == 0 and gcfreeze.holders() == 0
    gc.disable()
    with CheckpointManager(str(tmp_path / "b"), {"model": _model()}, every_n_steps=1, compression=None):
        assert gc.get_freeze_count() == 0, "the application manages its collector: do not freeze"
        assert not gc.isenabled()
    assert gc.get_freeze_count() == 0


def test_objects_made_after_the_freeze_are_still_collected(tmp_path, gc_restored) -> None:
    gc.unfreeze()
    with CheckpointManager(str(tmp_path), {"model": _model()}, every_n_steps=1, compression=None) as mgr:
        garbage = _Cycle()
        dead = weakref.ref(garbage)
        del garbage
        gc.collect()
        assert dead() is None
        assert mgr.maybe_save(1)


def test_files_are_planned_before_the_copies_are_waited_for(tmp_path, monkeypatch) -> None:
    """The committer pickles and lays out every file first; ``before_write`` (the copy wait) comes after."""
    from checkpointd import writer as writer_mod

    seen: list[tuple[str, int, int]] = []
    orig_plan = writer_mod.BackgroundWriter.plan_job

    def plan_job(self, job):
        orig_plan(self, job)
        seen.append(("planned", len(job.files), sum(f.image is not None for f in job.files)))
        orig_before = job.before_write

        def before_write():
            seen.append(("before_write", len(job.files), 0))
            orig_before()
        job.before_write = before_write

    monkeypatch.setattr(writer_mod.BackgroundWriter, "plan_job", plan_job)
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    with CheckpointManager(str(tmp_path), {"model": model, "optim": opt}, every_n_steps=1, compression=None) as mgr:
        assert mgr.save(1) is None
        mgr.wait()
        stats = mgr.stats()
    assert seen[0][0] == "planned" and seen[0][1] >= 2 and seen[0][2] == seen[0][1], seen
    assert seen[1] == ("before_write", seen[0][1], 0), "the files were planned before the copy wait"
    assert "plan_secs" in stats["last_save"]
    state = load(str(tmp_path), 1)
    for k, v in model.state_dict().items():
        assert torch.equal(state["model"][k], v)


def test_planning_runs_at_a_short_gil_switch_interval_and_puts_it_back(tmp_path, monkeypatch) -> None:
    """While the committer plans, the training thread must get the GIL back quickly: the interpreter's
    switch interval is lowered to ``PLAN_GIL_SWITCH_INTERVAL_SECS`` for the planning only."""
    import sys

    from checkpointd import writer as writer_mod

    seen: list[tuple[str, float]] = []
    orig_plan_job = writer_mod.BackgroundWriter.plan_job

    def plan_job(self, job):
        orig_plan_files = job.plan_files

        def plan_files():
            seen.append(("planning", sys.getswitchinterval()))
            orig_plan_files()
        job.plan_files = plan_files
        orig_plan_job(self, job)
        seen.append(("planned", sys.getswitchinterval()))

    monkeypatch.setattr(writer_mod.BackgroundWriter, "plan_job", plan_job)
    before = sys.getswitchinterval()
    assert before > writer_mod.PLAN_GIL_SWITCH_INTERVAL_SECS
    with CheckpointManager(str(tmp_path / "a"), {"model": _model()}, every_n_steps=1, compression=None) as mgr:
        mgr.save(1)
        mgr.wait()
    assert seen[0] == ("planning", pytest.approx(writer_mod.PLAN_GIL_SWITCH_INTERVAL_SECS)), seen
    assert seen[1][1] == pytest.approx(min(before, writer_mod.GIL_SWITCH_INTERVAL_SECS)), "back to the writer's interval"
    assert sys.getswitchinterval() == pytest.approx(before), "the application's interval is put back"

    seen.clear()
    monkeypatch.setenv("CHECKPOINTD_PLAN_SWITCH_INTERVAL_SECS", "0")
    with CheckpointManager(str(tmp_path / "b"), {"model": _model()}, every_n_steps=1, compression=None) as mgr:
        mgr.save(1)
        mgr.wait()
    assert seen[0] == ("planning", pytest.approx(min(before, writer_mod.GIL_SWITCH_INTERVAL_SECS))), "0 turns it off"
    assert sys.getswitchinterval() == pytest.approx(before)


def test_run_tasks_lanes_bound_concurrency_and_keep_order() -> None:
    live, peak = [0], [0]
    lock = threading.Lock()

    def task(i: int):
        def run() -> int:
            with lock:
                live[0] += 1
                peak[0] = max(peak[0], live[0])
            time.sleep(0.002)
            with lock:
                live[0] -= 1
            return i * i
        return run

    out = ptlayout.run_tasks([task(i) for i in range(40)], lanes=3)
    assert out == [i * i for i in range(40)]
    assert 1 <= peak[0] <= 3, peak[0]


def test_run_tasks_lanes_stop_after_a_failure() -> None:
    ran: list[int] = []

    def task(i: int):
        def run() -> int:
            ran.append(i)
            if i == 2:
                raise OSError("disk on fire")
            time.sleep(0.001)
            return i
        return run

    with pytest.raises(OSError, match="disk on fire"):
        ptlayout.run_tasks([task(i) for i in range(200)], lanes=2)
    assert len(ran) < 200, "tasks after the failure must not start"


def test_write_lanes_come_from_the_environment(monkeypatch) -> None:
    monkeypatch.delenv(ptlayout.WRITE_LANES_ENV, raising=False)
    assert ptlayout.write_lanes() == 4
    monkeypatch.setenv(ptlayout.WRITE_LANES_ENV, "1")
    assert ptlayout.write_lanes() == 1
    monkeypatch.setenv(ptlayout.WRITE_LANES_ENV, "junk")
    assert ptlayout.write_lanes() == 4


def test_files_needing_a_copied_value_are_planned_after_the_wait_the_rest_once(tmp_path, monkeypatch) -> None:
    """A GradScaler's scale lives in the training-state file: the model file is pickled ahead, once;
    the training-state file after the copies, and the scale saved is the live one."""
    import checkpointd.savejob as savejob_mod
    import checkpointd.state as state_mod

    def scaler_state_dict(scaler):  # as on CUDA: the scale is read from the staged copy, not with .item()
        return {**scaler.state_dict(), "scale": state_mod.DeferredScalar(scaler._scale, float)}
    monkeypatch.setattr(state_mod, "scaler_state_dict", scaler_state_dict)
    calls = []
    inner = savejob_mod.plan_pt

    def plan_pt(tree, **kw):
        calls.append(sorted(tree) if isinstance(tree, dict) else type(tree).__name__)
        return inner(tree, **kw)
    monkeypatch.setattr(savejob_mod, "plan_pt", plan_pt)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(model(torch.randn(2, 8)).sum()).backward()  # the scale is now a tensor (a DeferredScalar)
    scaler.step(opt)
    scaler.update()
    scale = scaler.get_scale()
    with CheckpointManager(tmp_path, {"model": model, "optimizer": opt, "scaler": scaler}, compression=None) as mgr:
        mgr.save(1)
    files = [c for c in calls if c != "list"]  # "list": the staging buffers pre-pickled when prepared ahead
    assert len(files) == 2, calls  # each file pickled exactly once
    ckpt = torch.load(tmp_path / "step-000000001" / "checkpoint.0.1.pt", weights_only=True)
    assert ckpt["scaler_state_dict"]["scale"] == scale
