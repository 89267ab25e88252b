"""Sharded restore reads only the shard files a rank needs (gloo on CPU; nccl with CHECKPOINTD_TEST_BACKEND=nccl).

Saved at 4 ranks with every tensor ``Shard(0)`` over 4 (rows 2r, 2r+1 in rank r's file), restored at 2:
rank 0's rows 0..3 live in the files of ranks 0 and 1, rank 1's rows 4..7 in those of ranks 2 and 3.
Rank 0's file is read by everyone (the entries skeleton and the plain tensors). Reads are counted at the
storage level: the restore goes through ``faulty://`` with a fault plan whose only rule is a pure
"delay" of zero seconds on reads, so every read is recorded in ``plan.injected`` and none fails.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

from dist_harness import assert_same_state, fsdp2_with_adamw, gathered_state, run_distributed, train_same_batches

from adversarial import craft

import checkpointd
from checkpointd import CheckpointManager, DistributedOptions


class Even(nn.Module):
    """Every parameter has 8 rows: Shard(0) over 4 ranks gives 2 rows each, over 2 ranks 4 rows each."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def save_at_4(rank: int, world: int, root: str) -> Any:
    model, opt = fsdp2_with_adamw(Even, seed=0)
    train_same_batches(model, opt, 2, seed=11, features=6)
    for _, p in model.named_parameters():
        assert [type(pl).__name__ for pl in p.placements] == ["Shard"] and p.placements[0].dim == 0
    with CheckpointManager(root, {"model": model, "optim": opt}, mode="sharded", compression="zstd", every_n_steps=1, distributed=DistributedOptions(timeout_secs=30)) as mgr:
        mgr.save(2)
    full = gathered_state(model, opt)  # collective
    return full if rank == 0 else None


def restore_counting_reads(rank: int, world: int, root: str) -> Any:
    """Restore twice: into a fresh optimizer (no state yet), then into one that has state; log shard reads."""
    from checkpointd.testing.faults import Fault, FaultPlan

    model, opt = fsdp2_with_adamw(Even, seed=5)  # different init: everything must come from the checkpoint
    out: dict[str, Any] = {"reads": [], "full": []}
    plan = FaultPlan(Fault(op="read", path=lambda p: "/shards/" in p, error=None))
    with CheckpointManager(f"faulty://{root}", {"model": model, "optim": opt}, mode="sharded", compression="zstd", distributed=DistributedOptions(timeout_secs=30),
                           storage_options={"target_protocol": "file", "faults": plan}) as mgr:
        for attempt in range(2):
            if attempt == 1:
                train_same_batches(model, opt, 1, seed=3, features=6)  # live optimizer state now exists and differs from the checkpoint
            plan.injected.clear()
            assert mgr.restore_latest() == 2
            out["reads"].append(sorted({Path(f.path).name for f in plan.injected}))
            full = gathered_state(model, opt)  # collective
            out["full"].append(full if rank == 0 else None)
    train_same_batches(model, opt, 1, seed=7, features=6)  # training goes on from the restored state
    return out


def restore_expecting_corruption(rank: int, world: int, root: str) -> Any:
    """Only rank 1 reads the damaged file; every rank must refuse, and nothing may be applied anywhere."""
    from checkpointd.errors import CorruptCheckpointError

    model, opt = fsdp2_with_adamw(Even, seed=5)
    train_same_batches(model, opt, 1, seed=3, features=6)
    before = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
    error = ""
    with CheckpointManager(root, {"model": model, "optim": opt}, mode="sharded", compression="zstd", distributed=DistributedOptions(timeout_secs=30)) as mgr:
        try:
            mgr.restore(2)
        except CorruptCheckpointError as exc:
            error = str(exc)
    unchanged = all(torch.equal(p.to_local(), before[n]) for n, p in model.named_parameters())
    return {"error": error, "unchanged": unchanged}


def test_reshard_4_to_2_reads_only_overlapping_shard_files(tmp_path: Path) -> None:
    root = str(tmp_path)
    saved = run_distributed(save_at_4, 4, root)[0]
    results = run_distributed(restore_counting_reads, 2, root)
    for attempt in range(2):
        assert results[0]["reads"][attempt] == ["rank-00000.pt.zst", "rank-00001.pt.zst"], results[0]["reads"]
        assert results[1]["reads"][attempt] == ["rank-00000.pt.zst", "rank-00002.pt.zst", "rank-00003.pt.zst"], results[1]["reads"]
        assert_same_state(results[0]["full"][attempt], saved)
    # checkpointd.load still assembles the whole checkpoint from every shard file
    data = checkpointd.load(root)
    for k, t in saved["model"].items():
        assert torch.equal(data["model"][k], t), k
    assert torch.equal(data["optim"]["state"]["b.weight"]["exp_avg_sq"], saved["state"]["b.weight"]["exp_avg_sq"])


def test_damaged_shard_needed_by_one_rank_fails_every_rank(tmp_path: Path) -> None:
    root = str(tmp_path)
    run_distributed(save_at_4, 4, root)
    damaged = Path(root, "step-000000002", "shards", "rank-00003.pt.zst")
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    results = run_distributed(restore_expecting_corruption, 2, root)
    for r in results:
        assert "does not verify on every rank" in r["error"] and "rank-00003" in r["error"], r["error"]
        assert r["unchanged"]


def save_two_steps(rank: int, world: int, root: str) -> Any:
    model, opt = fsdp2_with_adamw(Even, seed=0)
    with CheckpointManager(root, {"model": model, "optim": opt}, mode="sharded", compression="zstd", distributed=DistributedOptions(timeout_secs=30)) as mgr:
        for step in (1, 2):
            train_same_batches(model, opt, 1, seed=step, features=6)
            mgr.save(step)
            mgr.wait()
            if step == 1:
                at_1 = gathered_state(model, opt)  # collective
    return at_1 if rank == 0 else None


def resume_past_damage(rank: int, world: int, root: str) -> Any:
    """restore_latest skips the damaged step 2 on every rank, rank 0 takes it out of the checkpoints,
    and the resumed loop saves step 2 again."""
    import warnings

    model, opt = fsdp2_with_adamw(Even, seed=5)
    with CheckpointManager(root, {"model": model, "optim": opt}, mode="sharded", compression="zstd", distributed=DistributedOptions(timeout_secs=30)) as mgr:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            start = mgr.resume()
        restored = gathered_state(model, opt)  # collective
        steps_after = mgr.steps()
        mgr.save(2)
        mgr.wait()
        final = mgr.steps()
    return {"start": start, "warned": any("skipping step 2" in str(w.message) for w in caught),
            "steps_after": steps_after, "final": final, "restored": restored if rank == 0 else None}


@pytest.mark.parametrize("damage", ["a flipped byte", "an unsafe pickle"])
def test_damaged_newest_step_falls_back_on_every_rank_and_is_saved_again(tmp_path: Path, damage: str) -> None:
    """Only rank 1 reads the damaged shard file. With an unsafe pickle its checksums all match: rank 1 alone
    finds it unsafe while unpickling, and every rank must still skip the same step."""
    root = str(tmp_path)
    at_1 = run_distributed(save_two_steps, 2, root)[0]
    step_dir = Path(root, "step-000000002")
    damaged = step_dir / "shards" / "rank-00001.pt.zst"
    if damage == "a flipped byte":
        data = bytearray(damaged.read_bytes())
        data[len(data) // 2] ^= 0xFF
        damaged.write_bytes(bytes(data))
    else:
        rel = "shards/rank-00001.pt.zst"
        native = craft.native_bytes(step_dir, rel)
        hostile = craft.op_global("os", "system") + craft.MARK + craft.op_str("true") + craft.TUPLE + craft.REDUCE + craft.POP
        pkl = craft.inject_into_pickle(craft.zip_member(native, "data.pkl"), hostile)
        craft.forge_native(step_dir, rel, craft.zip_replace(native, "data.pkl", pkl))
    results = run_distributed(resume_past_damage, 2, root)
    for r in results:
        assert r["start"] == 2 and r["warned"] and r["steps_after"] == [1] and r["final"] == [1, 2], r
    assert_same_state(results[0]["restored"], at_1)
    (aside,) = Path(root, ".checkpointd-damaged").iterdir()  # moved once, by rank 0
    assert aside.name.startswith("step-000000002-") and (aside / "shards" / "rank-00001.pt.zst").exists()


def restore_with_a_read_error_on_rank1(rank: int, world: int, root: str) -> Any:
    """Rank 1 cannot read its shard file (an error that is not damage: it must not skip the step); every
    rank stops at that step, no rank goes on to an older one."""
    import time

    from checkpointd.testing.faults import Fault, FaultPlan

    model, opt = fsdp2_with_adamw(Even, seed=5)
    before = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
    faults = [Fault(op="read", path=lambda p: "/step-000000002/shards/" in p, error=lambda op, path: PermissionError(13, "denied (test)"))]
    plan = FaultPlan(*(faults if rank == 1 else []))
    t0 = time.monotonic()
    try:
        with CheckpointManager(f"faulty://{root}", {"model": model, "optim": opt}, mode="sharded", compression="zstd",
                               distributed=DistributedOptions(timeout_secs=30),
                               storage_options={"target_protocol": "file", "faults": plan}) as mgr:
            got = mgr.restore_latest()
        error = f"restored step {got}"
    except Exception as exc:  # noqa: BLE001 - the test reports what each rank raised
        error = f"{type(exc).__name__}: {exc}"
    return {"error": error, "secs": time.monotonic() - t0,
            "unchanged": all(torch.equal(p.to_local(), before[n]) for n, p in model.named_parameters())}


def test_an_error_that_is_not_damage_on_one_rank_stops_every_rank_at_that_step(tmp_path: Path) -> None:
    root = str(tmp_path)
    run_distributed(save_two_steps, 2, root)
    r0, r1 = run_distributed(restore_with_a_read_error_on_rank1, 2, root)
    assert "denied (test)" in r1["error"] and not r1["error"].startswith("restored"), r1
    assert r0["error"].startswith("CheckpointError") and "could not be read on every rank: rank 1:" in r0["error"], r0
    assert "denied (test)" in r0["error"] and r0["unchanged"] and r1["unchanged"]
    assert r0["secs"] < 20 and r1["secs"] < 20  # within the coordination timeout: no rank waited for another
    assert sorted(p.name for p in Path(root).glob("step-*")) == ["step-000000001", "step-000000002"]  # nothing set aside
