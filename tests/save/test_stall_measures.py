"""What keeps the training thread's share of a save small, beyond the copy itself.

- ``gcfreeze``: full garbage collections triggered by a save's objects must not walk the whole heap;
- the writer pickles and lays out the files *before* waiting for the snapshot copies;
- ``iopool.run_tasks(lanes=...)``: a file is written by a bounded number of threads.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
import torch

from checkpointd.storage import iopool
from checkpointd import CheckpointManager, StagingOptions
from checkpointd.save import gcfreeze
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
    held = 0
    while gcfreeze.holders():  # (the session's own hold too: tests/conftest.py)
        gcfreeze.release()
        held += 1
    yield
    while gcfreeze.holders():
        gcfreeze.release()
    gc.unfreeze()
    if enabled:
        gc.enable()
    else:
        gc.disable()
    for _ in range(held):
        gcfreeze.acquire()


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
                           staging=StagingOptions(freeze_gc=False)):
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
    """The committer pickles and lays out every file first; ``planning.wait_for_copies`` comes after."""
    from checkpointd.save import planning
    from checkpointd.save import writer as writer_mod

    seen: list[tuple[str, int, int]] = []
    orig_plan = writer_mod.BackgroundWriter.plan_job
    orig_wait = planning.wait_for_copies

    def plan_job(self, job):
        orig_plan(self, job)
        seen.append(("planned", len(job.files), sum(f.image is not None for f in job.files)))

    def wait_for_copies(job):
        seen.append(("wait_for_copies", len(job.files), 0))
        orig_wait(job)

    monkeypatch.setattr(writer_mod.BackgroundWriter, "plan_job", plan_job)
    monkeypatch.setattr(planning, "wait_for_copies", wait_for_copies)
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    with CheckpointManager(str(tmp_path), {"model": model, "optim": opt}, every_n_steps=1, compression=None) as mgr:
        assert mgr.save(1) is None
        mgr.wait()
        stats = mgr.stats()
    assert seen[0][0] == "planned" and seen[0][1] >= 2 and seen[0][2] == seen[0][1], seen
    assert seen[1] == ("wait_for_copies", seen[0][1], 0), "the files were planned before the copy wait"
    assert "plan_secs" in stats["last_save"]
    state = load(str(tmp_path), 1)
    for k, v in model.state_dict().items():
        assert torch.equal(state["model"][k], v)


def _plan(job) -> None:
    from checkpointd.save import writer as writer_mod

    w = object.__new__(writer_mod.BackgroundWriter)  # plan_job needs no store for a job without files
    writer_mod.BackgroundWriter.plan_job(w, job)


class _Copies:
    """Stands in for ``device_copies.PendingCopies``: what ``planning.training_waits`` reads."""

    def __init__(self, waits) -> None:
        self.defer_planning = waits is not None
        self.training_waits = waits


class _Waits:
    def __init__(self, wait) -> None:
        self.wait = wait


def _job(waits=None):
    from checkpointd.save.job import SaveJob
    from checkpointd.save.snapshot import StagedTensors

    staged = StagedTensors(staged=[], arena=None, copies=_Copies(waits))
    return SaveJob(step=1, step_dir="step_1", manifest=None, staged=staged)  # type: ignore[arg-type]


def test_deferred_planning_waits_for_the_training_thread(monkeypatch) -> None:
    """A large CUDA snapshot's planning waits for its ``training_waits`` (the training thread's next
    optimizer step), at most ``PLAN_WAIT_SECS``. Without it (small snapshots, CPU), for a preemption
    save, or with ``PLAN_WAIT_SECS`` 0, planning starts at once."""
    from checkpointd.save import planning
    from checkpointd.save import writer as writer_mod

    ready = threading.Event()
    seen: list[str] = []
    real_plan_files = planning.plan_files

    def plan_files(job, copied=True):
        seen.append("planning")
        return real_plan_files(job, copied)

    monkeypatch.setattr(planning, "plan_files", plan_files)
    job = _job(_Waits(lambda secs: seen.append(f"waiting {secs}") or ready.wait(secs)))
    threading.Timer(0.2, ready.set).start()
    _plan(job)
    assert seen == [f"waiting {writer_mod.PLAN_WAIT_SECS}", "planning"], seen
    assert 0.15 <= job.timings["plan_wait_secs"] < writer_mod.PLAN_WAIT_SECS

    seen.clear()
    job = _job()
    _plan(job)
    assert seen == ["planning"] and "plan_wait_secs" not in job.timings

    seen.clear()
    job = _job(_Waits(lambda secs: seen.append(f"waiting {secs}")))
    job.fast = True  # a preemption save: its grace period is short, plan at once
    _plan(job)
    assert seen == ["planning"]

    seen.clear()
    monkeypatch.setattr(writer_mod, "PLAN_WAIT_SECS", 0.0)
    job = _job(_Waits(lambda secs: seen.append(f"waiting {secs}")))
    _plan(job)
    assert seen == ["planning"]


def test_cpu_saves_plan_at_once(tmp_path) -> None:
    """CPU tensors are copied inside ``maybe_save``: nothing to wait for, the job plans at once."""
    with CheckpointManager(str(tmp_path), {"model": _model()}, every_n_steps=1, compression=None) as mgr:
        mgr.save(1)
        mgr.wait()
        assert "plan_wait_secs" not in mgr.stats()["last_save"]


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

    out = iopool.run_tasks([task(i) for i in range(40)], lanes=3)
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
        iopool.run_tasks([task(i) for i in range(200)], lanes=2)
    assert len(ran) < 200, "tasks after the failure must not start"


def test_write_lanes_come_from_the_constant(monkeypatch) -> None:
    from checkpointd.storage import writemode

    assert writemode.write_lanes() == writemode.WRITE_LANES == 4
    monkeypatch.setattr(writemode, "WRITE_LANES", 1)
    assert writemode.write_lanes() == 1


def test_files_needing_a_copied_value_are_planned_after_the_wait_the_rest_once(tmp_path, monkeypatch) -> None:
    """A GradScaler's scale lives in the training-state file: the model file is pickled ahead, once;
    the training-state file after the copies, and the scale saved is the live one."""
    import checkpointd.save.planning as planning_mod
    import checkpointd.state as state_mod

    def scaler_state_dict(scaler):  # as on CUDA: the scale is read from the staged copy, not with .item()
        return {**scaler.state_dict(), "scale": state_mod.DeferredScalar(scaler._scale, float)}
    monkeypatch.setattr(state_mod, "scaler_state_dict", scaler_state_dict)
    calls = []
    inner = planning_mod.plan_pt

    def plan_pt(tree, **kw):
        calls.append(sorted(tree) if isinstance(tree, dict) else type(tree).__name__)
        return inner(tree, **kw)
    monkeypatch.setattr(planning_mod, "plan_pt", plan_pt)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(model(torch.randn(2, 8)).sum()).backward()  # the scale is now a tensor (a DeferredScalar)
    scaler.step(opt)
    scaler.update()
    scale = scaler.get_scale()
    with CheckpointManager(tmp_path, {"model": model, "optimizer": opt, "scaler": scaler}, compression=None) as mgr:
        mgr.save(1)
    assert len(calls) == 2, calls  # each file pickled exactly once (the committer's planning steps)
    ckpt = torch.load(tmp_path / "step-000000001" / "checkpoint.0.1.pt", weights_only=True)
    assert ckpt["scaler_state_dict"]["scale"] == scale
