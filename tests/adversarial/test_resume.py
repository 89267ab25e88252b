"""Resuming: ``resume()``, falling back past a damaged newest step (which stops being committed and is
moved aside), and re-saving steps after a restore (the run branched) or without one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import checkpointd
from checkpointd import CheckpointManager, StepAlreadyExistsError
from checkpointd.format import layout

from . import craft
from .craft import BAD, DAMAGED_DIR, GOOD


@pytest.fixture(params=[None, "zstd"], ids=["raw", "zstd"])
def compression(request: pytest.FixtureRequest) -> str | None:
    return request.param


# -- resume() -----------------------------------------------------------------------------------------
def test_resume_of_an_empty_root_returns_first_step(root: Path) -> None:
    with CheckpointManager(str(root), craft.new_state(), compression=None) as mgr:
        assert mgr.resume() == 0
        assert mgr.resume(first_step=7) == 7


def test_resume_restores_the_newest_step_and_returns_the_next(root: Path, compression: str | None) -> None:
    run = craft.save_run(root, compression=compression)
    state = craft.new_state(seed=5)
    with CheckpointManager(str(root), state, compression=compression) as mgr:
        assert mgr.resume() == BAD + 1
        craft.assert_values(state, run.values[BAD], run.progress[BAD])


def test_requeued_job_with_only_step_zero_committed_never_raises(root: Path) -> None:
    """The README loop, restarted again and again: each attempt dies before its next checkpoint."""
    state = craft.new_state()
    with CheckpointManager(str(root), state, compression=None, every_n_steps=100) as mgr:
        start = mgr.resume()
        assert start == 0
        mgr.maybe_save(start)  # step 0 is a checkpoint; the job is preempted right after it
    for attempt in range(4):
        state = craft.new_state(seed=attempt + 1)
        with CheckpointManager(str(root), state, compression=None, every_n_steps=100, at_steps=(1,) if attempt == 3 else ()) as mgr:
            start = mgr.resume()
            assert start == 1, f"attempt {attempt}: resume() returned {start} with only step 0 committed"
            for step in range(start, start + 3):
                mgr.maybe_save(step)  # the last attempt checkpoints step 1
    with CheckpointManager(str(root), craft.new_state(), compression=None) as mgr:
        assert mgr.steps() == [0, 1]
        assert mgr.resume() == 2


# -- a damaged newest step --------------------------------------------------------------------------
def _flip(d: Path) -> None:
    craft.flip_byte(d / craft.data_file(d))


def _truncate(d: Path) -> None:
    f = d / craft.data_file(d)
    f.write_bytes(f.read_bytes()[:-9])


def _garbage_manifest(d: Path) -> None:
    craft.sign_raw_manifest(d, b"\x00garbage, not JSON \xff")


DAMAGE = {"flipped-byte": _flip, "truncated": _truncate, "garbage-manifest": _garbage_manifest}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_newest_falls_back_and_is_moved_aside(root: Path, compression: str | None, damage: str) -> None:
    run = craft.save_run(root, compression=compression)
    DAMAGE[damage](run.step_dir(BAD))
    mgr = craft.assert_restores(run, GOOD)
    try:
        assert mgr.steps() == [GOOD] and mgr.latest_step() == GOOD
        assert not (run.step_dir(BAD) / layout.COMMIT_MARKER_NAME).exists(), "the damaged step is still committed"
        aside = [p.name for p in (root / DAMAGED_DIR).iterdir()] if (root / DAMAGED_DIR).is_dir() else []
        assert any(n.startswith(layout.step_dir_name(BAD)) for n in aside), f"step {BAD} not under {DAMAGED_DIR}: {aside}"
        code, out = craft.cli("ls", root)
        assert code == 0 and layout.step_dir_name(BAD) not in out.replace(DAMAGED_DIR, "")
    finally:
        mgr.close()


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_resumed_loop_reaches_the_damaged_step_and_saves_it(root: Path, compression: str | None, damage: str) -> None:
    run = craft.save_run(root, compression=compression)
    DAMAGE[damage](run.step_dir(BAD))
    state = craft.new_state(seed=3)
    with CheckpointManager(str(root), state, compression=compression, every_n_steps=GOOD, keep_last=None) as mgr:
        with pytest.warns(RuntimeWarning, match=str(BAD)):
            start = mgr.resume()
        assert start == GOOD + 1
        for step in range(start, BAD + 1):
            craft.advance(state, step)
            mgr.maybe_save(step)  # saves step BAD again: it must not raise
        mgr.wait()
        expected = craft.state_values(state)
        assert mgr.steps() == [GOOD, BAD]
    code, out = craft.cli("verify", root)
    assert code == 0, out
    fresh = craft.new_state(seed=4)
    with CheckpointManager(str(root), fresh, compression=compression) as mgr:
        assert mgr.restore_latest() == BAD
        craft.assert_values(fresh, expected)


def test_retention_no_longer_counts_the_damaged_step(root: Path) -> None:
    run = craft.save_run(root)
    _flip(run.step_dir(BAD))
    state = craft.new_state(seed=3)
    with CheckpointManager(str(root), state, compression=None, keep_last=2) as mgr:
        with pytest.warns(RuntimeWarning, match=str(BAD)):
            assert mgr.restore_latest() == GOOD
        mgr.save(GOOD + 1)
        mgr.wait()
        assert mgr.steps() == [GOOD, GOOD + 1], "retention kept the damaged step and dropped a good one"
    assert craft.step_dir(root, GOOD).is_dir()


# -- saving a committed step again ------------------------------------------------------------------
def test_resaving_a_committed_step_without_a_restore_raises(root: Path) -> None:
    craft.save_run(root)
    with CheckpointManager(str(root), craft.new_state(), compression=None) as mgr:
        with pytest.raises(StepAlreadyExistsError):
            mgr.save(BAD)


def test_resaving_the_restored_step_raises(root: Path) -> None:
    craft.save_run(root)
    with CheckpointManager(str(root), craft.new_state(), compression=None) as mgr:
        assert mgr.restore_latest() == BAD
        with pytest.raises(StepAlreadyExistsError):
            mgr.save(BAD)
        mgr.restore(GOOD)
        with pytest.raises(StepAlreadyExistsError):
            mgr.save(GOOD)


def test_overwrite_true_replaces_a_committed_step(root: Path) -> None:
    craft.save_run(root)
    state = craft.new_state(seed=8)
    with CheckpointManager(str(root), state, compression=None, overwrite=True) as mgr:
        mgr.save(BAD)
        mgr.wait()
        expected = craft.state_values(state)
    assert torch.equal(checkpointd.load(str(root))["model"]["weight"], expected["model.weight"])


def test_branch_after_restore_replaces_a_newer_step_with_a_warning(root: Path, compression: str | None) -> None:
    craft.save_run(root, steps=(GOOD, BAD), compression=compression)
    state = craft.new_state(seed=6)
    with CheckpointManager(str(root), state, compression=compression) as mgr:
        mgr.restore(GOOD)
        craft.advance(state, BAD)
        with pytest.warns(RuntimeWarning) as caught:
            mgr.save(BAD)
            mgr.wait()
        expected = craft.state_values(state)
        assert mgr.steps() == [GOOD, BAD]
    texts = [str(w.message) for w in caught]
    assert any(str(GOOD) in t and str(BAD) in t for t in texts), f"no warning naming steps {GOOD} and {BAD}: {texts}"
    assert torch.equal(checkpointd.load(str(root), step=BAD)["model"]["weight"], expected["model.weight"])
