"""Tensor subclasses under FSDP2 (2 gloo ranks): torchao's float8 training with the float8 all-gather
(parameters are DTensors whose local tensors are ``WeightWithDynamicFloat8CastTensor``). Sharded mode
refuses them at ``maybe_save`` with a StateError naming the parameter and ``mode='full'``, and writes
nothing; full mode saves the gathered state and restores it into fresh FSDP2 ranks bit for bit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from dist_harness import assert_same_state, gathered_state, run_distributed, world_mesh

from checkpointd import CheckpointManager, DistributedOptions, StagingOptions, StateError


def _model(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=True))
    fully_shard(model, mesh=world_mesh())
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    g = torch.Generator().manual_seed(7)
    for _ in range(steps):
        x = torch.randn(8, 32, generator=g)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def scenario(rank: int, world_size: int, root: str) -> dict[str, Any]:
    opts = dict(compression=None, keep_last=None, staging=StagingOptions(freeze_gc=False),
                distributed=DistributedOptions(timeout_secs=30))
    model, opt = _model(0)
    _train(model, opt, 2)
    out: dict[str, Any] = {}
    local = type(next(model.parameters()).to_local()).__name__
    out["local_class"] = local
    with CheckpointManager(Path(root) / "sharded", {"model": model, "optim": opt}, mode="sharded", **opts) as mgr:
        try:
            mgr.save(2)
        except StateError as exc:
            out["sharded_error"] = str(exc)
        out["sharded_steps"] = mgr.steps()
    with CheckpointManager(Path(root) / "full", {"model": model, "optim": opt}, mode="full", **opts) as mgr:
        mgr.save(2)
    saved = gathered_state(model, opt)
    fresh, fresh_opt = _model(1)
    _train(fresh, fresh_opt, 1)  # optimizer state to restore into
    with CheckpointManager(Path(root) / "full", {"model": fresh, "optim": fresh_opt}, mode="full", **opts) as mgr:
        out["restored"] = mgr.restore_latest()
    assert_same_state(gathered_state(fresh, fresh_opt), saved)
    out["keys"] = sorted(saved["model"])
    return out


def test_float8_all_gather_parameters_refused_in_sharded_mode_and_exact_in_full_mode(tmp_path: Path) -> None:
    results = run_distributed(scenario, 2, str(tmp_path), deadline_secs=90)
    for r in results:
        assert r["local_class"] == "WeightWithDynamicFloat8CastTensor"
        assert "sharded checkpoints of tensor subclasses are not supported" in r["sharded_error"]
        assert "mode='full'" in r["sharded_error"] and "weight" in r["sharded_error"]
        assert r["sharded_steps"] == []
        assert r["restored"] == 2 and r["keys"]  # and the gathered state equal, bit for bit (asserted on each rank)
