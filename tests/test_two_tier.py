"""Two tiers (``local_dir=``): commit locally, upload in the background with the marker last, retention on
both tiers, ``restore_latest`` prefers a verified local copy and falls back to the remote."""

from __future__ import annotations

import shutil
import uuid
from typing import Any

import fsspec
import pytest
import torch

from checkpointd import CheckpointManager, CheckpointWriteError, IOOptions
from checkpointd.testing import Fault, FaultPlan


def _state(v: float = 0.0) -> dict[str, Any]:
    torch.manual_seed(0)
    return {"model": torch.nn.Linear(8, 8), "t": torch.full((32,), v), "meta": {"v": v}}


def _set(state: dict[str, Any], v: float) -> None:
    with torch.no_grad():
        state["model"].weight.fill_(v)
    state["t"].fill_(v)
    state["meta"]["v"] = v


def _check(state: dict[str, Any], v: float) -> None:
    assert state["meta"] == {"v": v} and torch.equal(state["t"], torch.full((32,), v))
    assert torch.equal(state["model"].weight, torch.full((8, 8), v))


def _memory_root() -> str:
    return f"memory://checkpointd-tiers/{uuid.uuid4().hex}"


def _remote_steps(root: str, opts: dict[str, Any] | None = None) -> list[int]:
    with CheckpointManager(root, _state(), storage_options=opts) as mgr:
        return mgr.steps()


def test_commit_local_then_upload_with_retention_on_both(tmp_path):
    root, local = _memory_root(), tmp_path / "local"
    state = _state()
    with CheckpointManager(root, state, local_dir=local, keep_last=2) as mgr:
        for step in range(1, 6):
            _set(state, float(step))
            mgr.save(step)
        mgr.wait()  # waits for the uploads too
        assert mgr.steps() == [4, 5]
    assert sorted(p.name for p in local.iterdir()) == ["step-000000004", "step-000000005"]
    assert _remote_steps(root) == [4, 5]
    fs = fsspec.filesystem("memory")
    names = {p.rsplit("/", 1)[-1] for p in fs.find(root.removeprefix("memory://") + "/step-000000005")}
    assert {"manifest.json", "COMMITTED"} <= names and len(names) >= 3
    live = _state(-1.0)
    with CheckpointManager(root, live) as mgr:  # the remote alone is a complete root
        assert mgr.restore_latest() == 5
    _check(live, 5.0)


def test_upload_order_is_data_manifest_marker(tmp_path):
    plan = FaultPlan(Fault(op="close", error=None))  # records every object as it lands
    root = f"faulty://{tmp_path}/remote"
    opts = {"target_protocol": "file", "faults": plan}
    with CheckpointManager(root, _state(), local_dir=tmp_path / "local", storage_options=opts) as mgr:
        mgr.save(3)
        mgr.wait()
    landed = [f.path.rsplit("/", 1)[-1] for f in plan.injected]
    assert landed[-2:] == ["manifest.json", "COMMITTED"] and len(landed) >= 3


def test_restore_prefers_local_and_falls_back_to_remote(tmp_path):
    root, local = _memory_root(), tmp_path / "local"
    state = _state()
    with CheckpointManager(root, state, local_dir=local, keep_last=None, compression="zstd") as mgr:
        for step in (1, 2):
            _set(state, float(step))
            mgr.save(step)
        mgr.wait()
    # damage the remote copy of step 2: the local copy (verified) is used, no warning
    fs = fsspec.filesystem("memory")
    remote_dir = root.removeprefix("memory://") + "/step-000000002"
    data = [p for p in fs.find(remote_dir) if p.endswith(".zst")]
    fs.pipe_file(data[0], b"garbage")
    live = _state(-1.0)
    with CheckpointManager(root, live, local_dir=local) as mgr:
        assert mgr.restore_latest() == 2
    _check(live, 2.0)
    # the node's disk is wiped: everything comes from the remote; a damaged remote step 2 falls back to 1
    shutil.rmtree(local)
    live = _state(-1.0)
    with CheckpointManager(root, live, local_dir=local) as mgr:
        with pytest.warns(RuntimeWarning, match="step 2"):
            assert mgr.restore_latest() == 1
        mgr.restore(1)
    _check(live, 1.0)
    # a damaged local copy falls back to the remote copy of the same step
    local2 = tmp_path / "local2"
    state = _state()
    root2 = _memory_root()
    with CheckpointManager(root2, state, local_dir=local2, compression="zstd") as mgr:
        _set(state, 7.0)
        mgr.save(7)
        mgr.wait()
    victim = next(p for p in (local2 / "step-000000007").iterdir() if p.name.endswith(".zst"))
    victim.write_bytes(b"garbage")
    live = _state(-1.0)
    with CheckpointManager(root2, live, local_dir=local2) as mgr:
        with pytest.warns(RuntimeWarning, match="does not verify"):
            assert mgr.restore_latest() == 7
    _check(live, 7.0)


def test_upload_failure_surfaces_and_local_copy_stays(tmp_path):
    plan = FaultPlan()
    root = f"faulty://{tmp_path}/remote"
    opts = {"target_protocol": "file", "faults": plan}
    state = _state()
    mgr = CheckpointManager(root, state, local_dir=tmp_path / "local", storage_options=opts, io=IOOptions(retry_timeout_secs=0.3))
    _set(state, 1.0)
    mgr.save(1)
    mgr.wait()
    plan.add(Fault(op="open", path="*/step-000000002/COMMITTED", error=lambda op, p: PermissionError(13, f"denied {p}")))
    _set(state, 2.0)
    mgr.save(2)
    with pytest.raises(CheckpointWriteError, match=r"upload of step 2 .*PermissionError.*committed locally") as info:
        mgr.wait()
    assert info.value.step == 2
    mgr.close()
    assert _remote_steps(f"{tmp_path}/remote") == [1]
    live = _state(-1.0)
    with CheckpointManager(root, live, local_dir=tmp_path / "local", storage_options={"target_protocol": "file"}) as m2:
        m2.wait()  # the restarted manager uploads the local-only step 2
        assert _remote_steps(f"{tmp_path}/remote") == [1, 2]
        assert m2.restore_latest() == 2
    _check(live, 2.0)


def test_slow_remote_keeps_pending_uploads_locally(tmp_path):
    plan = FaultPlan(Fault(op="close", error=None, delay_secs=0.05))
    root = f"faulty://{tmp_path}/remote"
    opts = {"target_protocol": "file", "faults": plan}
    state = _state()
    with CheckpointManager(root, state, local_dir=tmp_path / "local", storage_options=opts, keep_last=1,
                           max_pending=2) as mgr:
        for step in range(1, 7):
            _set(state, float(step))
            mgr.save(step)
        mgr.wait()
        assert mgr.steps() == [6]
    assert _remote_steps(f"{tmp_path}/remote") == [6]
    assert sorted(p.name for p in (tmp_path / "local").iterdir()) == ["step-000000006"]


def test_two_tiers_on_s3(tmp_path, s3_root, s3_storage_options):
    state = _state()
    with CheckpointManager(s3_root, state, local_dir=tmp_path / "local", storage_options=s3_storage_options,
                           keep_last=2) as mgr:
        for step in (1, 2, 3):
            _set(state, float(step))
            mgr.save(step)
        mgr.close(timeout=60)
    assert _remote_steps(s3_root, s3_storage_options) == [2, 3]
    shutil.rmtree(tmp_path / "local")
    live = _state(-1.0)
    with CheckpointManager(s3_root, live, local_dir=tmp_path / "local", storage_options=s3_storage_options) as mgr:
        assert mgr.restore_latest() == 3
    _check(live, 3.0)
