"""Crash consistency in one process (SPEC §2 "Commit"): a checkpoint exists iff its marker exists and
its manifest verifies; a save killed mid-write is never restored; damaged checkpoints are skipped with
a warning, and a root whose every committed step is damaged raises instead of restarting from scratch.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from checkpointd import (
    CheckpointError,
    CheckpointManager,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    load,
)

SRC = str(Path(__file__).resolve().parent.parent / "src")

KILLED_SAVE = textwrap.dedent(
    """
    import os, signal, sys, time
    sys.path.insert(0, {src!r})
    import torch
    from checkpointd import CheckpointManager
    from checkpointd.testing.faults import Fault, FaultPlan

    root, how, faulty = sys.argv[1], sys.argv[2], sys.argv[3] == "faulty"
    big = torch.full((4_000_000,), 1.0)  # 16 MB
    model = torch.nn.Linear(4, 4)
    with torch.no_grad():
        model.weight.fill_(1.0)
    state = {{"model": model, "big": big}}
    if faulty:  # every write of step 2 is slow: the kill certainly lands mid-write
        plan = FaultPlan()
        mgr = CheckpointManager("faulty://" + root, state, compression=None,
                                storage_options={{"target_protocol": "file", "faults": plan}})
    else:
        mgr = CheckpointManager(root, state, compression=None)
    mgr.save(1)
    mgr.wait()
    if faulty:
        writes_before = plan.calls["write"]
        plan.add(Fault(op="write", error=None, delay_secs=0.02, path="*step-000000002*"))
    big.fill_(2.0)
    with torch.no_grad():
        model.weight.fill_(2.0)
    mgr.save(2)
    if faulty:
        deadline = time.monotonic() + 10
        while plan.calls["write"] < writes_before + 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    print("killing", flush=True)
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(0)
    """
)


def _killed_save(root: Path, how: str, faulty: bool) -> None:
    script = KILLED_SAVE.format(src=SRC)
    proc = subprocess.run([sys.executable, "-c", script, str(root), how, "faulty" if faulty else "plain"],
                          capture_output=True, timeout=120)
    assert b"killing" in proc.stdout, proc.stderr.decode()[-3000:]
    expected_rc = -signal.SIGKILL if how == "sigkill" else 0
    assert proc.returncode == expected_rc, proc.stderr.decode()[-3000:]


def _fresh_state():
    return {"model": torch.nn.Linear(4, 4), "big": torch.zeros(4_000_000)}


@pytest.mark.parametrize("how", ["sigkill", "exit"])
def test_save_killed_mid_write_is_never_restored(tmp_path, how):
    _killed_save(tmp_path, how, faulty=True)
    step2 = tmp_path / "step-000000002"
    assert step2.is_dir() and any(step2.iterdir()), "the killed save had started writing"
    assert not (step2 / "COMMITTED").exists()
    state = _fresh_state()
    with CheckpointManager(tmp_path, state, compression=None) as mgr:
        assert mgr.steps() == [1]
        assert mgr.latest_step() == 1
        assert mgr.restore_latest() == 1
    assert torch.equal(state["big"], torch.full((4_000_000,), 1.0))
    assert torch.equal(state["model"].weight, torch.ones(4, 4))
    assert load(tmp_path)["big"][0].item() == 1.0


def test_save_killed_right_after_maybe_save_restores_a_consistent_step(tmp_path):
    """Without slowing the writer the kill may land before or after the commit: whichever step is
    restored, its values are that step's values, never a mix."""
    _killed_save(tmp_path, "sigkill", faulty=False)
    state = _fresh_state()
    with CheckpointManager(tmp_path, state, compression=None) as mgr:
        steps = mgr.steps()
        assert steps in ([1], [1, 2])
        restored = mgr.restore_latest()
    assert restored == steps[-1]
    assert torch.equal(state["big"], torch.full((4_000_000,), float(restored)))
    assert torch.equal(state["model"].weight, torch.full((4, 4), float(restored)))


# -- in-process damage ------------------------------------------------------------------------------
def _two_steps(root, compression="zstd"):
    model = torch.nn.Linear(3, 3)
    extra = {"step": 0}
    with CheckpointManager(root, {"model": model, "extra": extra}, compression=compression) as mgr:
        for s in (1, 2):
            with torch.no_grad():
                model.weight.fill_(float(s))
            extra["step"] = s
            mgr.save(s)
        mgr.wait()


def _restore_into_fresh(root, **kwargs):
    model = torch.nn.Linear(3, 3)
    with torch.no_grad():
        model.weight.fill_(-1.0)
    extra = {"step": -1}
    with CheckpointManager(root, {"model": model, "extra": extra}, **kwargs) as mgr:
        steps = mgr.steps()
        restored = mgr.restore_latest()
    return restored, steps, model, extra


def test_step_without_marker_is_not_listed_or_loaded(tmp_path):
    _two_steps(tmp_path)
    step2 = tmp_path / "step-000000002"
    (step2 / "COMMITTED").unlink()
    assert (step2 / "manifest.json").exists() and len(list(step2.iterdir())) == 3  # all data + manifest
    restored, steps, model, extra = _restore_into_fresh(tmp_path)
    assert steps == [1] and restored == 1
    assert extra == {"step": 1} and torch.equal(model.weight, torch.ones(3, 3))
    assert load(tmp_path)["extra"] == {"step": 1}
    with pytest.raises(CheckpointNotFoundError):
        load(tmp_path, step=2)
    with pytest.raises(IncompleteCheckpointError):
        load(step2)
    with CheckpointManager(tmp_path, {"model": torch.nn.Linear(3, 3), "extra": {}}) as mgr:
        with pytest.raises(CheckpointNotFoundError):
            mgr.restore(2)


def test_manifest_not_matching_marker_falls_back_with_warning(tmp_path):
    _two_steps(tmp_path)
    manifest = tmp_path / "step-000000002" / "manifest.json"
    doc = json.loads(manifest.read_bytes())
    doc["time"] = doc["time"] + 1.0
    manifest.write_text(json.dumps(doc))
    with pytest.warns(RuntimeWarning, match="step 2"):
        restored, steps, model, extra = _restore_into_fresh(tmp_path)
    assert steps == [1] and restored == 1  # a marker that does not match its manifest does not commit
    assert extra == {"step": 1} and torch.equal(model.weight, torch.ones(3, 3))
    (aside,) = (tmp_path / ".checkpointd-damaged").iterdir()  # moved aside once step 1 restored
    assert aside.name.startswith("step-000000002-") and not (tmp_path / "step-000000002").exists()


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("which", ["model", "training"])
def test_flipped_byte_in_newest_falls_back_with_warning(tmp_path, compression, which):
    _two_steps(tmp_path, compression)
    step2 = tmp_path / "step-000000002"
    prefix = "Linear" if which == "model" else "checkpoint"
    (data_file,) = [p for p in step2.iterdir() if p.name.startswith(prefix)]
    raw = bytearray(data_file.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data_file.write_bytes(bytes(raw))
    with pytest.warns(RuntimeWarning, match="step 2"):
        restored, _, model, extra = _restore_into_fresh(tmp_path, compression=compression)
    assert restored == 1
    assert extra == {"step": 1} and torch.equal(model.weight, torch.ones(3, 3))


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_truncated_or_missing_file_falls_back(tmp_path, damage):
    _two_steps(tmp_path)
    step2 = tmp_path / "step-000000002"
    (data_file,) = [p for p in step2.iterdir() if p.name.startswith("checkpoint")]
    if damage == "truncated":
        data_file.write_bytes(data_file.read_bytes()[:-10])
    else:
        data_file.unlink()
    with pytest.warns(RuntimeWarning):
        restored, steps, _, _ = _restore_into_fresh(tmp_path)
    assert restored == 1 and steps == [1, 2]
    assert _restore_into_fresh(tmp_path)[1] == [1]  # the damaged step was taken out once step 1 restored


def test_all_committed_steps_damaged_raises_and_touches_nothing(tmp_path):
    _two_steps(tmp_path)
    for step_dir in tmp_path.iterdir():
        for p in step_dir.iterdir():
            if p.name.startswith("Linear"):
                raw = bytearray(p.read_bytes())
                raw[-30] ^= 0xFF
                p.write_bytes(bytes(raw))
    model = torch.nn.Linear(3, 3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    extra = {"step": -1}
    with CheckpointManager(tmp_path, {"model": model, "extra": extra}) as mgr:
        with pytest.warns(RuntimeWarning):
            with pytest.raises(CheckpointError, match="none verifies") as info:
                mgr.restore_latest()
        assert isinstance(info.value, CorruptCheckpointError)
        assert mgr.steps() == [1, 2]  # none verified: both stay, so every restart raises again
    assert extra == {"step": -1}
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    assert not (tmp_path / ".checkpointd-damaged").exists()
    with pytest.raises(CorruptCheckpointError):
        load(tmp_path)
    with CheckpointManager(tmp_path, {"model": model, "extra": extra}) as mgr:
        with pytest.warns(RuntimeWarning), pytest.raises(CorruptCheckpointError, match="none verifies"):
            mgr.restore_latest()


def test_empty_root_restores_none(tmp_path):
    with CheckpointManager(tmp_path / "new", {"t": torch.zeros(1)}) as mgr:
        assert mgr.steps() == [] and mgr.latest_step() is None
        assert mgr.restore_latest() is None
