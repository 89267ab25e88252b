"""torchao float8 training under FSDP2 as torchao documents it (``precompute_float8_dynamic_scale_for_fsdp``
after every optimizer step), checkpointed in sharded mode on 2 gloo ranks and resumed in a fresh model.

The float8 all-gather weight (``WeightWithDynamicFloat8CastTensor``) carries a precomputed scale, a cache
of its weight's amax, that ``state_dict()`` drops (the weight's ``detach``). Every save records the same
inner tensors whether it went through a full ``get_model_state_dict`` call (the first save) or through
the manager's cached state-dict plan (the saves after it, which hold the parameters themselves), so a
later step restores into a model built afresh (no precomputed scale yet), and the resumed run's losses
and weights equal the uninterrupted run's bit for bit.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from dist_harness import run_distributed, world_mesh

from checkpointd import CheckpointManager, DistributedOptions, StagingOptions

warnings.filterwarnings("ignore", message=".*KernelPreference.*")

OPTS = dict(compression=None, keep_last=None, staging=StagingOptions(freeze_gc=False),
            distributed=DistributedOptions(timeout_secs=30))


def _model(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=True))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=world_mesh())
    fully_shard(model, mesh=world_mesh())
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _step(model: nn.Module, opt: torch.optim.Optimizer, i: int) -> torch.Tensor:
    from torchao.float8.fsdp_utils import precompute_float8_dynamic_scale_for_fsdp

    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(100 + i))
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    precompute_float8_dynamic_scale_for_fsdp(model)
    return loss.detach()


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        local = p._local_tensor
        out[name] = getattr(local, "_tensor", local).detach().clone()
    return out


def train_save_resume(rank: int, world: int, root: str) -> dict[str, Any]:
    model, opt = _model(0)
    with CheckpointManager(root, {"model": model, "optim": opt}, mode="sharded", **OPTS) as mgr:
        for i in range(1, 5):
            _step(model, opt, i)
            mgr.save(i)  # step 1 through get_model_state_dict, steps 2-4 through the cached plan
    want_losses = [_step(model, opt, i) for i in range(5, 8)]
    want = _weights(model)
    scale = model[0].weight._local_tensor._precomputed_scale
    out = {"precomputed_scale_in_live_weight": scale is not None}

    fresh, fresh_opt = _model(1)
    assert fresh[0].weight._local_tensor._precomputed_scale is None
    with CheckpointManager(root, {"model": fresh, "optim": fresh_opt}, mode="sharded", **OPTS) as mgr:
        out["restored"] = mgr.restore_latest()
    losses = [_step(fresh, fresh_opt, i) for i in range(5, 8)]
    got = _weights(fresh)
    out["losses_equal"] = all(torch.equal(a, b) for a, b in zip(losses, want_losses))
    out["weights_equal"] = sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    return out


def test_float8_precomputed_scales_save_alike_and_resume_bit_exact(tmp_path: Path) -> None:
    results = run_distributed(train_save_resume, 2, str(tmp_path), deadline_secs=90)
    for r in results:
        assert r == {"precomputed_scale_in_live_weight": True, "restored": 4, "losses_equal": True, "weights_equal": True}
    records = [json.loads((tmp_path / f"step-{s:09d}" / "manifest.json").read_text())["extra"]["sharded"]["tensors"]
               for s in (1, 4)]
    for rec in records:  # the first save and a cached-plan save record the weight alike
        weight = rec["model"]['["0.weight"]']
        assert weight["subclass"]["class"] == "torchao.float8.fsdp_utils.WeightWithDynamicFloat8CastTensor"
        assert sorted(weight["subclass"]["inner"]) == ["_tensor"]
