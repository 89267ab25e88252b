"""Resuming after a fallback, a branch or a stray marker: the loop goes on without an error, on the local
fast path and on an fsspec root alike."""

from __future__ import annotations

import json
import uuid
import warnings
from pathlib import Path

import fsspec
import pytest
import torch

from checkpointd import CheckpointManager, StateMismatchError, StepAlreadyExistsError


def _state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    return {"model": model, "optim": opt}


def _train(state: dict) -> None:
    state["optim"].zero_grad()
    state["model"](torch.randn(2, 8)).square().sum().backward()
    state["optim"].step()


@pytest.fixture(params=["local", "memory"])
def root(request, tmp_path: Path) -> str:
    if request.param == "local":
        return str(tmp_path / "root")
    return f"memory://resume-{uuid.uuid4().hex}"


def _files(root: str):
    fs, path = fsspec.core.url_to_fs(root)
    return fs, path.rstrip("/")


def _flip_largest_data_file(root: str, step: int) -> None:
    fs, path = _files(root)
    d = f"{path}/step-{step:09d}"
    data = [f for f in fs.find(d) if f.rsplit("/", 1)[-1] not in ("manifest.json", "COMMITTED")]
    victim = max(data, key=lambda f: fs.size(f))
    raw = bytearray(fs.cat_file(victim))
    raw[len(raw) // 2] ^= 0x01
    fs.pipe_file(victim, bytes(raw))


def test_resume_starts_after_the_only_checkpoint_step_zero(root: str) -> None:
    for restart in range(3):
        state = _state()
        with CheckpointManager(root, state, every_n_steps=1, compression=None) as mgr:
            start = mgr.resume()
            assert start == restart
            mgr.maybe_save(start)
    with CheckpointManager(root, _state(), compression=None) as mgr:
        assert mgr.steps() == [0, 1, 2]
        assert mgr.resume(first_step=5) == 3


def test_resume_on_an_empty_root_returns_first_step(root: str) -> None:
    with CheckpointManager(root, _state()) as mgr:
        assert mgr.resume() == 0
        assert mgr.resume(first_step=1) == 1


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_fallback_takes_the_damaged_step_out_and_the_loop_saves_it_again(root: str, compression) -> None:
    state = _state()
    with CheckpointManager(root, state, every_n_steps=10, keep_last=2, compression=compression) as mgr:
        for step in range(21):
            _train(state)
            mgr.maybe_save(step)
    _flip_largest_data_file(root, 20)

    state = _state()
    with CheckpointManager(root, state, every_n_steps=10, keep_last=2, compression=compression) as mgr:
        with pytest.warns(RuntimeWarning, match="skipping step 20"):
            start = mgr.resume()
        assert start == 11
        assert mgr.steps() == [10] and mgr.latest_step() == 10
        fs, path = _files(root)
        aside = fs.ls(f"{path}/.checkpointd-damaged", detail=False)
        assert len(aside) == 1 and aside[0].rstrip("/").rsplit("/", 1)[-1].startswith("step-000000020-")
        assert b"failed verification" in fs.cat_file(f"{aside[0].rstrip('/')}/DAMAGED.txt")
        for step in range(start, 21):
            _train(state)
            mgr.maybe_save(step)  # reaches the damaged step again: saves it, no StepAlreadyExistsError
        mgr.wait()
        assert mgr.steps() == [10, 20]
    with CheckpointManager(root, _state(), compression=compression) as mgr:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert mgr.restore_latest() == 20


def test_restore_of_an_older_step_branches_and_replaces_newer_steps(root: str) -> None:
    state = _state()
    with CheckpointManager(root, state, every_n_steps=1, keep_last=2, compression=None) as mgr:
        for step in range(1, 6):
            _train(state)
            mgr.maybe_save(step)
        mgr.wait()
        assert mgr.steps() == [4, 5]
        mgr.restore(4)
        with pytest.raises(StepAlreadyExistsError):
            mgr.save(4)  # the restored step itself is not after the branch point
        _train(state)
        with pytest.warns(RuntimeWarning, match="step 5 replaces .* restored at step 4"):
            mgr.maybe_save(5)
        mgr.wait()
        branch5 = {k: v.clone() for k, v in state["model"].state_dict().items()}
        assert mgr.steps() == [4, 5]
    check = _state()
    with CheckpointManager(root, check, compression=None) as mgr:
        assert mgr.restore_latest() == 5
    for k, v in check["model"].state_dict().items():
        assert torch.equal(v, branch5[k])


def test_stale_steps_of_the_old_branch_are_not_counted_by_retention(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    state = _state()
    with CheckpointManager(root, state, every_n_steps=1, keep_last=2, compression=None) as mgr:
        for step in range(1, 5):
            mgr.maybe_save(step)
        mgr.wait()
        mgr.restore(3)
        with pytest.warns(RuntimeWarning, match="replaces"):
            mgr.save(4)
    # keep_last=2 of the resumed branch is [3, 4]: none of its steps is deleted for the abandoned branch's sake
    assert sorted(p.name for p in Path(root).glob("step-*")) == ["step-000000003", "step-000000004"]


def test_a_stray_directory_with_a_garbage_marker_is_never_counted(root: str) -> None:
    fs, path = _files(root)
    fs.makedirs(f"{path}/step-000000099", exist_ok=True)
    fs.pipe_file(f"{path}/step-000000099/COMMITTED", b"garbage")
    fs.pipe_file(f"{path}/step-000000099/manifest.json", b"{}")
    state = _state()
    with CheckpointManager(root, state, every_n_steps=1, keep_last=1, compression=None) as mgr:
        assert mgr.steps() == [] and mgr.resume() == 0
        for step in range(3):
            mgr.maybe_save(step)
        mgr.wait()
        assert mgr.steps() == [2]  # retention kept the real newest save, not the stray directory


def test_a_marker_copied_from_another_step_does_not_commit(root: str) -> None:
    with CheckpointManager(root, _state(), compression=None) as mgr:
        mgr.save(1)
        mgr.save(2)
        mgr.wait()
    fs, path = _files(root)
    marker = json.loads(fs.cat_file(f"{path}/step-000000001/COMMITTED"))
    fs.pipe_file(f"{path}/step-000000002/COMMITTED", json.dumps(marker).encode())
    with CheckpointManager(root, _state(), compression=None) as mgr:
        assert mgr.steps() == [1]


def test_an_optimizer_of_another_class_is_refused_naming_both(tmp_path: Path) -> None:
    state = _state()
    _train(state)
    with CheckpointManager(str(tmp_path), state, compression=None) as mgr:
        mgr.save(1)
    model = torch.nn.Linear(8, 4)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with CheckpointManager(str(tmp_path), {"model": model, "optim": sgd}, compression=None) as mgr:
        with pytest.raises(StateMismatchError, match=r"state\['optim'\] is a SGD, but step 1 saved a Adam"):
            mgr.restore_latest()
