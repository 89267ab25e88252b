"""The manager on a real S3 server (SeaweedFS on 127.0.0.1, see conftest): save, restore, retention
deleting remote objects, ``load()``, ``steps()``, and a root of 1,000 committed steps where
``restore_latest`` reads one manifest, not all of them."""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

import fsspec
import pytest
import torch

from checkpointd import CheckpointManager, CheckpointWriteError, IOOptions, load
from checkpointd.codecs.checksum import sha256_hex
from checkpointd.format.manifest import Manifest
from checkpointd.testing import Fault, FaultPlan


def _state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return {"model": model, "optimizer": opt, "counters": {"seen": seed}}


def _s3(opts: dict[str, Any]) -> Any:
    return fsspec.filesystem("s3", skip_instance_cache=True, **opts)


def _objects(opts: dict[str, Any], root: str) -> list[str]:
    return sorted(p for p in _s3(opts).find(root.removeprefix("s3://")) if not p.endswith("/"))


def _faulty(root: str, opts: dict[str, Any], plan: FaultPlan) -> tuple[str, dict[str, Any]]:
    return "faulty://" + root.removeprefix("s3://"), {"target_protocol": "s3", "target_options": opts, "faults": plan}


def test_save_restore_load_on_s3(s3_root, s3_storage_options):
    saved = _state(1)
    with CheckpointManager(s3_root, saved, storage_options=s3_storage_options, keep_last=None) as mgr:
        for step in (10, 20):
            saved["counters"]["seen"] = step
            mgr.save(step)
        mgr.wait()
        assert mgr.steps() == [10, 20]
        assert mgr.latest_step() == 20
    live = _state(2)
    with CheckpointManager(s3_root, live, storage_options=s3_storage_options) as mgr:
        assert mgr.restore_latest() == 20
        for a, b in zip(live["model"].state_dict().values(), saved["model"].state_dict().values()):
            assert torch.equal(a, b)
        assert live["counters"] == {"seen": 20}
        mgr.restore(10)
        assert live["counters"] == {"seen": 10}
    out = load(s3_root, storage_options=s3_storage_options)
    assert out["counters"] == {"seen": 20}
    assert torch.equal(out["model"]["0.weight"], saved["model"][0].weight.detach())
    assert load(s3_root, step=10, storage_options=s3_storage_options)["counters"] == {"seen": 10}
    names = {p.rsplit("/", 1)[-1] for p in _objects(s3_storage_options, s3_root + "/step-000000020")}
    assert {"manifest.json", "COMMITTED"} <= names


def test_retention_deletes_remote_objects(s3_root, s3_storage_options):
    state = _state(1)
    with CheckpointManager(s3_root, state, storage_options=s3_storage_options, keep_last=2) as mgr:
        for step in range(1, 6):
            mgr.save(step)
        mgr.wait()
        assert mgr.steps() == [4, 5]
    objects = _objects(s3_storage_options, s3_root)
    step_dirs = {p.removeprefix(s3_root.removeprefix("s3://") + "/").split("/")[0] for p in objects}
    assert step_dirs == {"step-000000004", "step-000000005"}
    # the prefixes of deleted steps are gone from a delimiter listing too (no empty "directories")
    listed = {p.rsplit("/", 1)[-1] for p in _s3(s3_storage_options).ls(s3_root.removeprefix("s3://"), refresh=True)}
    assert listed == {"step-000000004", "step-000000005"}


def test_marker_is_the_last_object_written_on_s3(s3_root, s3_storage_options):
    plan = FaultPlan(Fault(op="close", path="*", error=None))  # records every committed object, in order
    root, opts = _faulty(s3_root, s3_storage_options, plan)
    with CheckpointManager(root, _state(1), storage_options=opts) as mgr:
        mgr.save(7)
        mgr.wait()
    closed = [f.path.rsplit("/", 1)[-1] for f in plan.injected if "step-000000007" in f.path]
    assert closed[-2:] == ["manifest.json", "COMMITTED"]
    assert len(closed) >= 3


def test_marker_write_failing_on_s3_commits_nothing(s3_root, s3_storage_options):
    plan = FaultPlan()
    root, opts = _faulty(s3_root, s3_storage_options, plan)
    state = _state(1)
    mgr = CheckpointManager(root, state, storage_options=opts, io=IOOptions(retry_timeout_secs=0.5))
    mgr.save(1)
    mgr.wait()
    plan.add(Fault(op="open", path="*/step-000000002/COMMITTED", error=lambda op, p: PermissionError(13, f"denied {p}")))
    mgr.save(2)
    with pytest.raises(CheckpointWriteError, match=r"step 2 .*PermissionError"):
        mgr.wait()
    assert mgr.steps() == [1]
    mgr.close()
    assert CheckpointManager(s3_root, _state(3), storage_options=s3_storage_options).restore_latest() == 1


def _make_thousand_steps(root: str, opts: dict[str, Any], n: int) -> None:
    """Steps 0..n-1 committed: 0 and n-1 saved by the manager, ``n // 2`` a full copy of step 0, the
    others marker and manifest only (committed, listed, never read), written in one concurrent PUT batch."""
    state = {"t": torch.zeros(4), "meta": {"step": 0}}
    with CheckpointManager(root, state, storage_options=opts, keep_last=None, compression=None) as mgr:
        mgr.save(0)
        mgr.wait()
    fs = _s3(opts)
    base = root.removeprefix("s3://")
    src = f"{base}/step-000000000"
    manifest = Manifest.from_json(fs.cat_file(f"{src}/manifest.json"))
    blobs = {f.path: fs.cat_file(f"{src}/{f.path}") for f in manifest.files}
    batch: dict[str, bytes] = {}
    for step in range(1, n - 1):
        d = f"{base}/step-{step:09d}"
        full = step == n // 2  # one full copy of step 0's data, to load below
        if full:
            batch.update({f"{d}/{name}": blob for name, blob in blobs.items()})
        data = dataclasses.replace(manifest, step=step, files=manifest.files if full else []).to_json()
        batch[f"{d}/manifest.json"] = data
        batch[f"{d}/COMMITTED"] = json.dumps(
            {"manifest": "manifest.json", "manifest_checksum": sha256_hex(data), "step": step}).encode()
    fs.pipe(batch)  # concurrent PUTs; marker order does not matter here, nothing reads them meanwhile
    state["t"].fill_(float(n - 1))
    state["meta"]["step"] = n - 1
    with CheckpointManager(root, state, storage_options=opts, keep_last=None, compression=None) as mgr:
        mgr.save(n - 1)
        mgr.wait()


def test_restore_latest_of_1000_steps_reads_one_manifest(s3_root, s3_storage_options):
    n = 1000
    t0 = time.perf_counter()
    _make_thousand_steps(s3_root, s3_storage_options, n)
    build_secs = time.perf_counter() - t0
    # count manifest reads (and listings) through a recording plan: delay-less faults that never raise
    plan = FaultPlan(Fault(op="read", path="*/manifest.json", error=None),
                     Fault(op="ls", error=None))
    root, opts = _faulty(s3_root, s3_storage_options, plan)
    state = {"t": torch.ones(4), "meta": {"step": -1}}
    with CheckpointManager(root, state, storage_options=opts, keep_last=None) as mgr:
        steps = mgr.steps()
        assert len(steps) == n and steps[0] == 0 and steps[-1] == n - 1
        plan.injected.clear()
        t1 = time.perf_counter()
        assert mgr.restore_latest() == n - 1
        restore_secs = time.perf_counter() - t1
    manifest_reads = [f for f in plan.injected if f.op == "read"]
    listings = [f for f in plan.injected if f.op == "ls"]
    assert len(manifest_reads) == 1, manifest_reads[:5]
    assert len(listings) <= 2, listings[:5]
    assert state["meta"] == {"step": n - 1} and torch.equal(state["t"], torch.full((4,), float(n - 1)))
    print(f"built {n} steps in {build_secs:.1f}s; restore_latest {restore_secs:.2f}s")
    # and an older copy restores too (the built steps are real checkpoints)
    out = load(s3_root, step=n // 2, storage_options=s3_storage_options)
    assert out["meta"] == {"step": 0}
