"""Faults through the public API (``faulty://`` roots, see ``checkpointd.testing.faults``): transient
write failures are retried and commit, timeouts too, a failing marker write commits nothing, a
permanent failure surfaces within ``IOOptions.retry_timeout_secs`` at the next ``maybe_save``/``wait``/``close``,
every failed save is reported exactly once, and slow storage never blocks non-saving steps."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from checkpointd import CheckpointManager, CheckpointWriteError, IOOptions
from checkpointd.testing import Fault, FaultPlan, permanent_error, timeout_error, transient_error


def _state(value: float = 0.0) -> dict[str, Any]:
    torch.manual_seed(0)
    return {"model": torch.nn.Linear(16, 16), "t": torch.full((64,), value), "meta": {"v": value}}


def _set(state: dict[str, Any], value: float) -> None:
    with torch.no_grad():
        state["model"].weight.fill_(value)
    state["t"].fill_(value)
    state["meta"]["v"] = value


def _mgr(tmp_path, plan: FaultPlan, state: dict[str, Any], **kwargs: Any) -> CheckpointManager:
    opts = {"target_protocol": "file", "faults": plan}
    kwargs.setdefault("keep_last", None)
    return CheckpointManager(f"faulty://{tmp_path}/ckpt", state, storage_options=opts, **kwargs)


def _restored(tmp_path, step: int | None = None) -> tuple[int | None, dict[str, Any]]:
    live = _state(-1.0)
    with CheckpointManager(tmp_path / "ckpt", live) as mgr:
        got = mgr.restore_latest() if step is None else (mgr.restore(step) or step)
    return got, live


def _check_value(state: dict[str, Any], value: float) -> None:
    assert state["meta"] == {"v": value}
    assert torch.equal(state["t"], torch.full((64,), value))
    assert torch.equal(state["model"].weight, torch.full((16, 16), value))


@pytest.mark.parametrize("op, probability", [("write", 0.15), ("close", 0.3), ("open", 0.3)])
def test_a_fraction_of_transient_failures_still_commits(tmp_path, op, probability):
    """(A file has several writes and one open and close: a lower chance per write fails as many files.)"""
    plan = FaultPlan(Fault(op=op, probability=probability, error=transient_error), seed=3)
    state = _state()
    with _mgr(tmp_path, plan, state, io=IOOptions(retry_timeout_secs=30)) as mgr:
        for step in range(1, 9):
            _set(state, float(step))
            mgr.save(step)
        mgr.wait()
        assert mgr.steps() == list(range(1, 9))
    assert plan.failures(op), "the plan never fired; the test proves nothing"
    for step in (1, 5, 8):
        got, live = _restored(tmp_path, step)
        _check_value(live, float(step))


def test_timeouts_are_retried_and_commit(tmp_path):
    plan = FaultPlan(Fault(op=("close", "info", "ls"), probability=0.25, delay_secs=0.02, error=timeout_error), seed=1)
    state = _state()
    with _mgr(tmp_path, plan, state, io=IOOptions(retry_timeout_secs=30)) as mgr:
        for step in (1, 2, 3):
            _set(state, float(step))
            mgr.save(step)
        mgr.wait()
    assert plan.failures()
    got, live = _restored(tmp_path)
    assert got == 3
    _check_value(live, 3.0)


@pytest.mark.parametrize("how", ["open", "write", "close"])
def test_exactly_the_marker_write_failing_commits_nothing(tmp_path, how):
    plan = FaultPlan()
    state = _state()
    mgr = _mgr(tmp_path, plan, state, io=IOOptions(retry_timeout_secs=0.3))
    _set(state, 1.0)
    mgr.save(1)
    mgr.wait()
    plan.add(Fault(op=how, path="*/step-000000002/COMMITTED", error=transient_error))  # never heals
    _set(state, 2.0)
    mgr.save(2)
    with pytest.raises(CheckpointWriteError, match=r"step 2 .*(ConnectionResetError|injected)") as info:
        mgr.wait()
    assert info.value.step == 2
    assert mgr.steps() == [1]
    assert not (tmp_path / "ckpt" / "step-000000002" / "COMMITTED").exists()
    mgr.close()
    got, live = _restored(tmp_path)
    assert got == 1
    _check_value(live, 1.0)


def test_lost_ack_on_the_marker_still_commits_once(tmp_path):
    plan = FaultPlan(Fault(op="close", path="*/COMMITTED", lands=True, times=1))
    state = _state()
    with _mgr(tmp_path, plan, state) as mgr:
        _set(state, 4.0)
        mgr.save(4)
        mgr.wait()
        assert mgr.steps() == [4]
    assert len(plan.failures("close")) == 1
    _check_value(_restored(tmp_path)[1], 4.0)


@pytest.mark.parametrize("where", ["maybe_save", "wait", "close"])
def test_permanent_failure_surfaces_within_the_retry_budget(tmp_path, where):
    budget = 1.0
    plan = FaultPlan()
    state = _state()
    mgr = _mgr(tmp_path, plan, state, io=IOOptions(retry_timeout_secs=budget))
    mgr.save(1)
    mgr.wait()
    plan.add(Fault(op="write", error=transient_error))  # storage went down for good
    t0 = time.monotonic()
    mgr.save(2)
    with pytest.raises(CheckpointWriteError, match=r"background save of step 2 .* failed: ConnectionResetError") as info:
        if where == "maybe_save":
            while time.monotonic() - t0 < 10 * budget:
                mgr.maybe_save(3, force=False)  # not due: only reports the failure once it is known
                time.sleep(0.01)
        elif where == "wait":
            mgr.wait()
        else:
            mgr.close()
    elapsed = time.monotonic() - t0
    assert info.value.step == 2
    assert elapsed < budget + 2.0, f"took {elapsed:.1f}s for a {budget}s retry budget"
    assert "gave up" in "".join(getattr(info.value.__cause__, "__notes__", []))
    plan.clear()
    mgr.close()
    assert _restored(tmp_path)[0] == 1


def test_permission_error_is_not_retried(tmp_path):
    plan = FaultPlan(Fault(op="open", path="*/step-000000002/*", error=permanent_error))
    state = _state()
    mgr = _mgr(tmp_path, plan, state, io=IOOptions(retry_timeout_secs=60))
    mgr.save(1)
    t0 = time.monotonic()
    mgr.save(2)
    with pytest.raises(CheckpointWriteError, match=r"step 2 .*PermissionError"):
        mgr.wait()
    assert time.monotonic() - t0 < 5.0
    paths = [f.path for f in plan.failures()]
    assert len(paths) == len(set(paths)), "a PermissionError was retried"
    mgr.close()


def test_every_failed_save_is_reported_exactly_once(tmp_path):
    plan = FaultPlan(Fault(op="open", path=lambda p: "step-000000003" in p or "step-000000006" in p,
                           error=permanent_error))
    state = _state()
    reported: list[int] = []
    mgr = _mgr(tmp_path, plan, state, io=IOOptions(retry_timeout_secs=5))
    for step in range(1, 10):
        _set(state, float(step))
        try:
            mgr.save(step)
        except CheckpointWriteError as exc:
            reported.append(exc.step)
            mgr.save(step)  # the failure was for an earlier step; this one still saves
    try:
        mgr.close()
    except CheckpointWriteError as exc:
        reported.append(exc.step)
        mgr.close()
    assert sorted(reported) == [3, 6]
    steps = _restored(tmp_path)
    assert steps[0] == 9
    with CheckpointManager(tmp_path / "ckpt", _state()) as check:
        assert check.steps() == [1, 2, 4, 5, 7, 8, 9]


def test_slow_storage_blocks_only_the_save_that_exceeds_max_pending(tmp_path):
    delay = 0.25
    plan = FaultPlan(Fault(op="close", error=None, delay_secs=delay))  # every object takes `delay` to land
    state = _state()
    call_secs: dict[int, float] = {}
    with _mgr(tmp_path, plan, state, every_n_steps=5, max_pending=1) as mgr:
        mgr.maybe_save(0)
        mgr.wait()
        for step in range(1, 13):
            t0 = time.perf_counter()
            mgr.maybe_save(step)
            call_secs[step] = time.perf_counter() - t0
            time.sleep(0.01)  # a training step
        mgr.wait()
        assert mgr.steps() == [0, 5, 10]
    # a save takes >= 3 * delay (data files, manifest, marker); none of it is on the training thread
    # except when a second save must wait for the first (max_pending=1)
    non_saving = [call_secs[s] for s in call_secs if s % 5]
    assert max(non_saving) < 0.05, call_secs
    assert call_secs[5] < delay, call_secs  # step 0 is done; step 5 starts at once
    # step 5's save (>= 3 * delay) is still running at step 10: that call, and only it, waits for it
    assert 2 * delay < call_secs[10] < 10 * delay, call_secs


def test_back_to_back_saves_wait_for_the_oldest_only(tmp_path):
    delay = 0.2
    plan = FaultPlan(Fault(op="close", error=None, delay_secs=delay))
    state = _state()
    with _mgr(tmp_path, plan, state, max_pending=1) as mgr:
        mgr.save(0)  # the first save also takes the root's lease (a write, then a read-back on object stores)
        mgr.wait()
        t0 = time.perf_counter()
        mgr.save(1)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        assert mgr.maybe_save(2) is False  # not due: never waits
        not_due = time.perf_counter() - t0
        t0 = time.perf_counter()
        mgr.save(3)  # must wait for save 1 (max_pending=1)
        second = time.perf_counter() - t0
        mgr.wait()
    assert first < delay and not_due < 0.02
    assert second >= 2 * delay * 0.9, (first, second)
