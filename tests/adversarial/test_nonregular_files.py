"""Fifos, directories and links where a checkpoint's data file, manifest or marker should be: reads never
block and never follow a link; each is damage, named, and the newest good step is still used."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from checkpointd import CheckpointManager, CorruptCheckpointError, IncompleteCheckpointError, load
from checkpointd.storage.store import Store

from . import craft

pytestmark = pytest.mark.timeout(60)

KINDS = ["fifo", "directory", "symlink"]


def _plant(path: Path, kind: str, outside: Path) -> None:
    """Replace ``path`` by a ``kind``; a symlink points to a copy of the very same bytes outside the root."""
    copy = outside / path.name
    shutil.copyfile(path, copy)
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        path.symlink_to(copy)


def _root_with_two_steps(root: Path) -> torch.nn.Linear:
    """Steps 1 and 2 committed; returns the model as of step 1."""
    model = torch.nn.Linear(16, 16)
    with CheckpointManager(root, {"model": model}, every_n_steps=1, keep_last=None) as mgr:
        mgr.save(1)
        mgr.wait()
        first = torch.nn.Linear(16, 16)
        first.load_state_dict(model.state_dict())
        with torch.no_grad():
            model.weight.add_(1.0)
        mgr.save(2)
    return first


def _data_file(step_dir: Path) -> Path:
    return next(p for p in step_dir.iterdir() if p.name.startswith("Linear."))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("which", ["data", "manifest"])
def test_restore_latest_falls_back_past_a_nonregular_file(root, tmp_path, kind, which) -> None:
    first = _root_with_two_steps(root)
    step2 = root / "step-000000002"
    _plant(_data_file(step2) if which == "data" else step2 / "manifest.json", kind, tmp_path)
    fresh = torch.nn.Linear(16, 16)
    with CheckpointManager(root, {"model": fresh}) as mgr:
        assert mgr.restore_latest() == 1  # a data file: skipped with a warning; a manifest: step 2 is no commit
    assert torch.equal(fresh.weight, first.weight) and torch.equal(fresh.bias, first.bias)


@pytest.mark.parametrize("kind", KINDS)
def test_a_nonregular_marker_is_no_commit(root, tmp_path, kind) -> None:
    first = _root_with_two_steps(root)
    _plant(root / "step-000000002" / "COMMITTED", kind, tmp_path)
    fresh = torch.nn.Linear(16, 16)
    with CheckpointManager(root, {"model": fresh}) as mgr:
        assert mgr.restore_latest() == 1
    assert torch.equal(fresh.weight, first.weight)
    assert torch.equal(load(root)["model"]["weight"], first.weight)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("which", ["data", "manifest"])
def test_verify_names_a_nonregular_file_and_fails(root, tmp_path, kind, which) -> None:
    _root_with_two_steps(root)
    step2 = root / "step-000000002"
    target = _data_file(step2) if which == "data" else step2 / "manifest.json"
    _plant(target, kind, tmp_path)
    where = root if which == "data" else step2  # a step whose manifest does not match is no commit of the root
    code, out = craft.cli("verify", str(where))
    assert code != 0
    assert target.name in out


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("which", ["data", "manifest"])
def test_load_refuses_a_nonregular_file(root, tmp_path, kind, which) -> None:
    first = _root_with_two_steps(root)
    step2 = root / "step-000000002"
    if which == "data":
        target = _data_file(step2)
        _plant(target, kind, tmp_path)
        with pytest.raises(CorruptCheckpointError, match=target.name):
            load(root)
    else:  # a marker that does not match its manifest commits nothing: the root's newest is step 1
        _plant(step2 / "manifest.json", kind, tmp_path)
        assert torch.equal(load(root)["model"]["weight"], first.weight)
        with pytest.raises(IncompleteCheckpointError, match="manifest.json"):
            load(step2)


@pytest.mark.parametrize("kind", KINDS)
def test_store_reads_refuse_a_nonregular_file_without_blocking(root, tmp_path, kind) -> None:
    """The Store's own reads: a CorruptCheckpointError naming the file and what it is."""
    _root_with_two_steps(root)
    step2 = root / "step-000000002"
    target = _data_file(step2)
    _plant(target, kind, tmp_path)
    store = Store(root)
    rel = f"step-000000002/{target.name}"
    what = {"fifo": "fifo", "directory": "directory", "symlink": "symbolic link"}[kind]
    with pytest.raises(CorruptCheckpointError, match=f"{target.name} is not a regular file \\({what}\\)"):
        store.read_bytes(rel)
    with pytest.raises(CorruptCheckpointError, match=f"{target.name} is not a regular file \\({what}\\)"):
        store.open_read(rel)
    assert not store.is_file(rel) and store.exists(rel)


def test_store_reads_refuse_a_path_through_a_linked_step(root, tmp_path) -> None:
    _root_with_two_steps(root)
    shutil.move(root / "step-000000002", tmp_path / "moved")
    (root / "step-000000002").symlink_to(tmp_path / "moved", target_is_directory=True)
    store = Store(root)
    with pytest.raises(CorruptCheckpointError, match="step-000000002"):
        store.read_bytes("step-000000002/manifest.json")
    assert not store.exists("step-000000002/manifest.json")
    with pytest.raises(FileNotFoundError):
        store.size("step-000000002/manifest.json")
