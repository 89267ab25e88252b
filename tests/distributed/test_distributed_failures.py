"""A rank failing mid-save: the error reaches every rank, nothing is committed, later saves still work.
Also: time-based saves agree across ranks (rank 0 decides)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch.nn as nn

from dist_harness import device, run_distributed

from checkpointd import CheckpointManager, CheckpointWriteError, DistributedOptions, IOOptions


def rank_fails(rank: int, world: int, root: str, mode: str) -> Any:
    from checkpointd.testing.faults import Fault, FaultPlan

    model = nn.Linear(4, 4).to(device())
    plan = FaultPlan(Fault(op="write", error=lambda op, path: OSError(28, "No space left on device")))
    plan.enabled = False
    if rank == 1:
        mgr = CheckpointManager(f"faulty://{root}", {"model": model}, mode=mode, io=IOOptions(retry_timeout_secs=0.2),
                                storage_options={"target_protocol": "file", "faults": plan}, distributed=DistributedOptions(timeout_secs=30))
    else:
        mgr = CheckpointManager(root, {"model": model}, mode=mode, distributed=DistributedOptions(timeout_secs=30))
    mgr.save(1)
    mgr.wait()
    plan.enabled = True
    mgr.save(2)
    errors = []
    try:
        mgr.wait()
    except CheckpointWriteError as exc:
        errors.append(str(exc))
    steps_after_failure = mgr.steps()
    plan.enabled = False
    mgr.save(3)
    mgr.close()
    return {"errors": errors, "steps_after_failure": steps_after_failure, "steps": mgr.steps()}


@pytest.mark.parametrize("mode", ["sharded", "full"])
def test_rank_failure_surfaces_everywhere_and_commits_nothing(tmp_path: Path, mode: str) -> None:
    results = run_distributed(rank_fails, 2, str(tmp_path), mode)
    for r in results:
        assert len(r["errors"]) == 1 and "rank 1" in r["errors"][0] and "step 2" in r["errors"][0]
        assert r["steps_after_failure"] == [1]
        assert r["steps"] == [1, 3]
    assert not (tmp_path / "step-000000002" / "COMMITTED").exists()


def time_schedule(rank: int, world: int, root: str) -> Any:
    model = nn.Linear(2, 2).to(device())
    decisions = []
    with CheckpointManager(root, {"model": model}, every_n_seconds=0.05, mode="sharded", distributed=DistributedOptions(timeout_secs=30)) as mgr:
        for step in range(1, 9):
            time.sleep(0.02 * (1 + rank))  # the ranks' clocks disagree on purpose
            decisions.append(mgr.maybe_save(step))
    return decisions


def test_time_based_schedule_agrees_across_ranks(tmp_path: Path) -> None:
    a, b = run_distributed(time_schedule, 2, str(tmp_path))
    assert a == b and any(a)
