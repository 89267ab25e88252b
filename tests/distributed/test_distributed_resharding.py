"""FSDP2 under torch.distributed (gloo on CPU; nccl with CHECKPOINTD_TEST_BACKEND=nccl): sharded and full
modes, the resharding matrix (2 -> 1, 3, 4; 4 -> 2), cross-mode restores and per-rank RNG.

Every scenario compares full tensors gathered on the restoring side with the ones gathered on the
saving side, bit for bit (``torch.equal``), model and optimizer state both.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

from dist_harness import assert_same_state, device, fsdp2_with_adamw, gathered_state, run_distributed, train_same_batches

import checkpointd
from checkpointd import CheckpointManager, DistributedOptions


class Net(nn.Module):
    """Odd sizes, so FSDP2 shards are uneven (7 rows over 2/3/4 ranks; 3 rows over 4: one rank empty)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 7)
        self.b = nn.Linear(7, 3)
        self.register_buffer("seen", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += 1
        return self.b(torch.relu(self.a(x)))


def _assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert_same_state(got, want)
    assert [g["lr"] for g in got["groups"]] == [g["lr"] for g in want["groups"]]


# -- scenarios run on every rank ---------------------------------------------------------------------
def save_fsdp2(rank: int, world: int, root: str, mode: str) -> Any:
    model, opt = fsdp2_with_adamw(Net, seed=0)
    train_same_batches(model, opt, 2, seed=123, features=5)
    torch.manual_seed(1000 + rank)  # per-rank RNG to find back
    with CheckpointManager(root, {"model": model, "optim": opt}, mode=mode, compression="zstd", every_n_steps=1, distributed=DistributedOptions(timeout_secs=30)) as mgr:
        assert mgr.maybe_save(2)
        after_save = torch.rand(3)
        opt.param_groups[0]["lr"] = 0.5  # changes after the save must not leak into it
        train_same_batches(model, opt, 1, seed=7, features=5)
        mgr.wait()
        steps = mgr.steps()
    return {"steps": steps, "rng": after_save}


def saved_reference(rank: int, world: int) -> Any:
    """What the saved state must gather to: the same training without checkpointing."""
    model, opt = fsdp2_with_adamw(Net, seed=0)
    train_same_batches(model, opt, 2, seed=123, features=5)
    full = gathered_state(model, opt)  # collective: every rank
    return full if rank == 0 else None


def restore_fsdp2(rank: int, world: int, root: str) -> Any:
    model, opt = fsdp2_with_adamw(Net, seed=5)  # different init: everything must come from the checkpoint
    torch.manual_seed(99)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with CheckpointManager(root, {"model": model, "optim": opt}, mode="sharded", distributed=DistributedOptions(timeout_secs=30)) as mgr:
            step = mgr.restore_latest()
    rng = torch.rand(3)
    out = gathered_state(model, opt)
    local = {n: tuple(p.to_local().shape) for n, p in model.named_parameters()}
    train_same_batches(model, opt, 1, seed=7, features=5)  # training continues from the restored state
    return {"step": step, "full": out if rank == 0 else None, "rng": rng, "local_shapes": local,
            "rng_warning": any("RNG" in str(w.message) for w in caught)}


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    return run_distributed(saved_reference, 2)[0]


@pytest.fixture(scope="module")
def sharded_at_2(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[Any]]:
    root = str(tmp_path_factory.mktemp("sharded2"))
    return root, run_distributed(save_fsdp2, 2, root, "sharded")


def test_sharded_save_layout(sharded_at_2: tuple[str, list[Any]]) -> None:
    root, results = sharded_at_2
    assert [r["steps"] for r in results] == [[2], [2]]
    step_dir = Path(root, "step-000000002")
    assert sorted(p.name for p in (step_dir / "shards").iterdir()) == ["rank-00000.pt.zst", "rank-00001.pt.zst"]
    import json

    manifest = json.loads((step_dir / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["mode"] == "sharded"
    assert sorted(f["rank"] for f in manifest["files"]) == [0, 1]
    rec = manifest["extra"]["sharded"]["tensors"]["model"]['["a.weight"]']
    assert rec["global_shape"] == [7, 5] and rec["placements"] == ["S(0)"]
    assert [b["shape"] for b in rec["blocks"]] == [[4, 5], [3, 5]]
    assert '["state", "a.weight", "exp_avg"]' in manifest["extra"]["sharded"]["tensors"]["optim"]


@pytest.mark.parametrize("world", [1, 3, 4])
def test_reshard_2_to_n(sharded_at_2: tuple[str, list[Any]], reference: dict[str, Any], world: int) -> None:
    root, _ = sharded_at_2
    results = run_distributed(restore_fsdp2, world, root)
    assert all(r["step"] == 2 for r in results)
    _assert_same(results[0]["full"], reference)
    assert results[0]["rng_warning"]  # world size changed: RNG left alone, with a warning
    rows = [r["local_shapes"]["a.weight"][0] for r in results]
    assert sum(rows) == 7


def test_same_world_size_restores_per_rank_rng(sharded_at_2: tuple[str, list[Any]], reference: dict[str, Any]) -> None:
    root, saved = sharded_at_2
    results = run_distributed(restore_fsdp2, 2, root)
    _assert_same(results[0]["full"], reference)
    for r in range(2):
        assert torch.equal(results[r]["rng"], saved[r]["rng"])
        assert not results[r]["rng_warning"]


def test_reshard_4_to_2(tmp_path: Path, reference: dict[str, Any]) -> None:
    root = str(tmp_path)
    run_distributed(save_fsdp2, 4, root, "sharded")
    results = run_distributed(restore_fsdp2, 2, root)
    _assert_same(results[0]["full"], reference)


def test_sharded_checkpoint_loads_whole(sharded_at_2: tuple[str, list[Any]], reference: dict[str, Any]) -> None:
    """checkpointd.load and a single-process manager both see full, FQN-keyed tensors."""
    root, _ = sharded_at_2
    data = checkpointd.load(root)
    for k, t in reference["model"].items():
        assert torch.equal(data["model"][k], t)
    assert torch.equal(data["optim"]["state"]["a.weight"]["exp_avg"], reference["state"]["a.weight"]["exp_avg"])
    torch.manual_seed(3)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    with CheckpointManager(root, {"model": model, "optim": opt}) as mgr:
        assert mgr.restore_latest() == 2
    for k, t in reference["model"].items():
        assert torch.equal(model.state_dict()[k], t)
    names = [n for n, _ in model.named_parameters()]
    for i, n in enumerate(names):
        assert torch.equal(opt.state_dict()["state"][i]["exp_avg_sq"], reference["state"][n]["exp_avg_sq"])


# -- full mode and cross-mode -------------------------------------------------------------------------
def full_save_then_restore(rank: int, world: int, root: str) -> Any:
    model, opt = fsdp2_with_adamw(Net, seed=0)
    train_same_batches(model, opt, 2, seed=123, features=5)
    with CheckpointManager(root, {"model": model, "optim": opt}, mode="full", compression=None, distributed=DistributedOptions(timeout_secs=30)) as mgr:
        mgr.save(2)
    full = gathered_state(model, opt)  # collective: every rank
    return full if rank == 0 else None


def restore_full_or_single(rank: int, world: int, root: str) -> Any:
    model, opt = fsdp2_with_adamw(Net, seed=9)
    with CheckpointManager(root, {"model": model, "optim": opt}, distributed=DistributedOptions(timeout_secs=30)) as mgr:
        step = mgr.restore_latest()
    full = gathered_state(model, opt)  # collective: every rank
    return {"step": step, "full": full if rank == 0 else None}


def test_full_mode_physicsnemo_files_and_restore_at_3(tmp_path: Path, reference: dict[str, Any]) -> None:
    root = str(tmp_path)
    run_distributed(full_save_then_restore, 2, root)
    step_dir = tmp_path / "step-000000002"
    names = sorted(p.name for p in step_dir.iterdir() if p.is_file())
    assert names == ["COMMITTED", "Net.0.2.pt", "checkpoint.0.2.pt", "manifest.json"]
    weights = torch.load(step_dir / "Net.0.2.pt", weights_only=True)
    for k, t in reference["model"].items():
        assert torch.equal(weights[k], t)
    training = torch.load(step_dir / "checkpoint.0.2.pt", weights_only=True)
    assert training["epoch"] == 2
    assert set(training["optimizer_state_dict"]["state"]) == {"a.weight", "a.bias", "b.weight", "b.bias"}  # FQN keys
    results = run_distributed(restore_full_or_single, 3, root)
    assert results[0]["step"] == 2
    _assert_same(results[0]["full"], reference)


def test_single_process_checkpoint_restores_into_fsdp2_and_back(tmp_path: Path, reference: dict[str, Any]) -> None:
    torch.manual_seed(0)
    model = Net().to(device())  # the reference trained on this device (cuda:0 under nccl): same numerics
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    train_same_batches(model, opt, 2, seed=123, features=5)
    with CheckpointManager(tmp_path / "single", {"model": model, "optim": opt}) as mgr:
        mgr.save(2)
    results = run_distributed(restore_full_or_single, 2, str(tmp_path / "single"))
    _assert_same(results[0]["full"], reference)
    # and back: FSDP2 full save at 2 ranks -> plain single-process model
    run_distributed(full_save_then_restore, 2, str(tmp_path / "fsdp"))
    torch.manual_seed(4)
    plain = Net()
    popt = torch.optim.AdamW(plain.parameters(), lr=0.05, weight_decay=0.01)
    with CheckpointManager(tmp_path / "fsdp", {"model": plain, "optim": popt}) as mgr:
        assert mgr.restore_latest() == 2
    for k, t in reference["model"].items():
        assert torch.equal(plain.state_dict()[k], t)
    for i, (n, _) in enumerate(plain.named_parameters()):
        assert torch.equal(popt.state_dict()["state"][i]["exp_avg"], reference["state"][n]["exp_avg"])
