"""Retention through the manager (SPEC §2 "Retention"): what is left on disk after each scenario."""

from __future__ import annotations

import pytest
import torch

from checkpointd import CheckpointManager, load
from checkpointd.testing.faults import Fault, FaultPlan


def _dirs(root) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def _names(*steps: int) -> list[str]:
    return [f"step-{s:09d}" for s in steps]


def _run(root, steps, metrics=None, **kwargs):
    t = torch.zeros(3)
    with CheckpointManager(root, {"t": t}, every_n_steps=1, **kwargs) as mgr:
        for s in steps:
            t.fill_(s)
            assert mgr.maybe_save(s, metrics=(metrics or {}).get(s))
        mgr.wait()
        committed = mgr.steps()
    return committed


def test_keep_last_2_over_6_saves(tmp_path):
    assert _run(tmp_path, range(1, 7), keep_last=2) == [5, 6]
    assert _dirs(tmp_path) == _names(5, 6)
    assert torch.equal(load(tmp_path, step=5)["t"], torch.full((3,), 5.0))


def test_keep_last_none_keeps_all(tmp_path):
    assert _run(tmp_path, range(1, 7), keep_last=None) == [1, 2, 3, 4, 5, 6]
    assert _dirs(tmp_path) == _names(1, 2, 3, 4, 5, 6)


def test_default_keeps_three(tmp_path):
    assert _run(tmp_path, range(0, 6)) == [3, 4, 5]


def test_keep_every_n_steps(tmp_path):
    assert _run(tmp_path, range(1, 8), keep_last=1, keep_every_n_steps=3) == [3, 6, 7]
    assert _dirs(tmp_path) == _names(3, 6, 7)


@pytest.mark.parametrize("mode, best", [("min", 3), ("max", 2)])
def test_keep_best(tmp_path, mode, best):
    loss = {1: 0.9, 2: 5.0, 3: 0.1, 4: 0.7, 5: 0.8, 6: 0.6}
    metrics = {s: {"loss": v} for s, v in loss.items()}
    committed = _run(tmp_path, range(1, 7), metrics, keep_last=1, keep_best=1, best_metric="loss", best_mode=mode)
    assert committed == sorted({best, 6})
    assert _dirs(tmp_path) == _names(*sorted({best, 6}))
    assert load(tmp_path / _names(best)[0])["t"][0].item() == best


def test_keep_best_survives_a_new_manager(tmp_path):
    """The best step's metric is read back from its manifest by a manager that did not save it."""
    _run(tmp_path, [1, 2], {1: {"loss": 0.1}, 2: {"loss": 0.5}}, keep_last=1, keep_best=1, best_metric="loss")
    committed = _run(tmp_path, [3, 4], {3: {"loss": 0.3}, 4: {"loss": 0.4}}, keep_last=1, keep_best=1,
                     best_metric="loss")
    assert committed == [1, 4]


def test_uncommitted_leftover_of_an_earlier_crash_is_removed(tmp_path):
    _run(tmp_path, [1], keep_last=5)
    leftover = tmp_path / _names(3)[0]
    leftover.mkdir()
    (leftover / "checkpoint.0.3.pt.zst").write_bytes(b"half a file")
    (leftover / "junk").write_bytes(b"x" * 100)
    assert _run(tmp_path, [5], keep_last=5) == [1, 5]
    assert _dirs(tmp_path) == _names(1, 5)


def test_uncommitted_leftover_of_the_step_being_saved_is_replaced(tmp_path):
    leftover = tmp_path / _names(4)[0]
    leftover.mkdir(parents=True)
    (leftover / "junk").write_bytes(b"old")
    (leftover / "manifest.json").write_bytes(b"{not json")
    assert _run(tmp_path, [4]) == [4]
    files = sorted(p.name for p in leftover.iterdir())
    assert "junk" not in files and "COMMITTED" in files
    assert load(tmp_path)["t"][0].item() == 4


def test_leftover_cleanup_never_touches_committed_steps_kept_by_policy(tmp_path):
    _run(tmp_path, [1, 2], keep_last=None)
    (tmp_path / _names(3)[0]).mkdir()
    (tmp_path / "unrelated").mkdir()  # not a step directory: never touched
    assert _run(tmp_path, [4], keep_last=None) == [1, 2, 4]
    assert _dirs(tmp_path) == sorted(_names(1, 2, 4) + ["unrelated"])


def test_in_flight_saves_are_never_deleted(tmp_path):
    """keep_last=1 while later saves are queued behind a slow one: every save commits, newest wins."""
    plan = FaultPlan(Fault(op="open", error=None, delay_secs=0.15, path="*step-*"))
    t = torch.zeros(2)
    with CheckpointManager(f"faulty://{tmp_path}", {"t": t}, keep_last=1, max_pending=3,
                           storage_options={"target_protocol": "file", "faults": plan}) as mgr:
        for s in (1, 2, 3):
            t.fill_(s)
            assert mgr.maybe_save(s, force=True)
        assert mgr.stats()["saves_pending"] >= 2
        mgr.wait()
        stats = mgr.stats()
        assert mgr.steps() == [3]
    assert stats["saves_committed"] == 3 and stats["saves_failed"] == 0
    assert _dirs(tmp_path) == _names(3)
    assert load(tmp_path)["t"][0].item() == 3


def test_newest_committed_is_kept_when_an_older_step_is_saved_last(tmp_path):
    t = torch.zeros(1)
    with CheckpointManager(tmp_path, {"t": t}, keep_last=1) as mgr:
        t.fill_(10)
        mgr.save(10)
        mgr.wait()
        t.fill_(5)
        mgr.save(5)
        mgr.wait()
        assert 10 in mgr.steps()
    assert load(tmp_path)["t"][0].item() == 10
