"""Layout fidelity under torch.distributed: FSDP1 channels_last optimizer state, a 2-D mesh DTensor, DDP.

FSDP1 with ``use_orig_params=False`` scrambles a channels_last parameter's optimizer state on a naive
round trip (storage order on save, logical order on load); here the restored state must equal a plain,
unsharded replica trained on the same batches, and training must continue identically.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from dist_harness import device, run_distributed

import checkpointd
from checkpointd import CheckpointManager, DistributedOptions


def _conv_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(64, 2)).to(memory_format=torch.channels_last)


def _step(model: nn.Module, opt: torch.optim.Optimizer, g: torch.Generator) -> None:
    x = torch.randn(2, 3, 6, 6, generator=g).to(next(model.parameters()).device).contiguous(memory_format=torch.channels_last)
    model(x).square().sum().backward()
    opt.step()
    opt.zero_grad()


def fsdp1_channels_last(rank: int, world: int, root: str, mode: str) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    def wrapped() -> nn.Module:
        return FSDP(_conv_net().to(device()), use_orig_params=False, device_id=device())

    ref = _conv_net().to(device())  # unsharded replica on the same device, same batches
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    model = wrapped()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    g, gr = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    for _ in range(2):
        _step(model, opt, g)
        _step(ref, ref_opt, gr)
    with CheckpointManager(root, {"model": model, "optim": opt}, mode=mode, distributed=DistributedOptions(timeout_secs=30)) as mgr:
        mgr.save(2)
    fresh = FSDP(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(64, 2)).to(memory_format=torch.channels_last).to(device()),
                 use_orig_params=False, device_id=device())
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.01)
    with CheckpointManager(root, {"model": fresh, "optim": fresh_opt}, distributed=DistributedOptions(timeout_secs=30)) as mgr:
        assert mgr.restore_latest() == 2
    osd = get_optimizer_state_dict(fresh, fresh_opt, options=StateDictOptions(full_state_dict=True))
    names = [n for n, _ in ref.named_parameters()]
    # Bit-exact on CPU. On CUDA the sharded and unsharded convolutions may round differently, so a tight
    # tolerance there; the bug this guards against permutes the state, far outside it.
    same = torch.equal if device().type == "cpu" else (lambda a, b: torch.allclose(a, b, rtol=1e-4, atol=1e-7))
    mismatched = [(n, k) for i, n in enumerate(names) for k in ("exp_avg", "exp_avg_sq")
                  if not same(osd["state"][n][k].cpu(), ref_opt.state_dict()["state"][i][k].cpu())]
    _step(fresh, fresh_opt, g)
    _step(ref, ref_opt, gr)
    with FSDP.summon_full_params(fresh):
        params_equal = all(torch.allclose(a.cpu(), b.cpu(), atol=1e-6) for a, b in zip(fresh.parameters(), ref.parameters()))
    return {"mismatched": mismatched, "params_equal": params_equal}


def test_fsdp1_channels_last_optimizer_round_trip(tmp_path: Path) -> None:
    for mode in ("full", "sharded"):
        results = run_distributed(fsdp1_channels_last, 2, str(tmp_path / mode), mode)
        for r in results:
            assert r["mismatched"] == [], mode
            assert r["params_equal"], mode
    data = checkpointd.load(str(tmp_path / "full"))
    w = data["model"]["0.weight"]
    assert w.is_contiguous(memory_format=torch.channels_last)  # full-mode files keep channels_last


# -- 2-D mesh: a user-managed DTensor parameter sharded on the "domain" axis ---------------------------
class PosEmbed(nn.Module):
    def __init__(self, mesh: Any) -> None:
        super().__init__()
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        torch.manual_seed(0)
        full = torch.randn(2, 7, 3)
        self.pos = nn.Parameter(distribute_tensor(full.to(device()), mesh, [Replicate(), Shard(1)]))


def mesh_2d(rank: int, world: int, root: str, shape: tuple[int, int], action: str) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device().type, shape, mesh_dim_names=("ddp", "domain"))
    module = PosEmbed(mesh)
    opt = torch.optim.Adam(module.parameters(), lr=0.1)
    if action == "save":
        module.pos.grad = torch.ones_like(module.pos)
        opt.step()
        with CheckpointManager(root, {"embed": module, "optim": opt}, mode="sharded", distributed=DistributedOptions(timeout_secs=30)) as mgr:
            mgr.save(1)
    else:
        with torch.no_grad():
            module.pos.zero_()
        with CheckpointManager(root, {"embed": module, "optim": opt}, distributed=DistributedOptions(timeout_secs=30)) as mgr:
            assert mgr.restore_latest() == 1
    p = module.pos
    return {"type": type(p).__name__, "placements": [str(x) for x in p.placements],
            "local_shape": tuple(p.to_local().shape), "full": p.full_tensor().cpu(),
            "exp_avg": opt.state[p]["exp_avg"].full_tensor().cpu()}


def test_2d_mesh_shard1_restores_on_other_mesh_shapes(tmp_path: Path) -> None:
    root = str(tmp_path)
    saved = run_distributed(mesh_2d, 4, root, (2, 2), "save")
    assert [s["local_shape"] for s in saved] == [(2, 4, 3), (2, 3, 3), (2, 4, 3), (2, 3, 3)]
    for shape, world, local in (((1, 4), 4, [(2, 2, 3), (2, 2, 3), (2, 2, 3), (2, 1, 3)]), ((2, 1), 2, [(2, 7, 3)] * 2)):
        got = run_distributed(mesh_2d, world, root, shape, "restore")
        assert [g["local_shape"] for g in got] == local
        for g in got:
            assert g["type"] == "DTensor" and g["placements"] == ["R", "S(1)"]
            assert torch.equal(g["full"], saved[0]["full"])
            assert torch.equal(g["exp_avg"], saved[0]["exp_avg"])


# -- DDP: no "module." prefix in the files; restore into wrapped or unwrapped ---------------------------
def ddp_round_trip(rank: int, world: int, root: str) -> Any:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(nn.Linear(4, 3).to(device()))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2, 4, device=device())).sum().backward()
    opt.step()
    with CheckpointManager(root, {"model": model, "optim": opt}, mode="full", compression=None, distributed=DistributedOptions(timeout_secs=30)) as mgr:
        mgr.save(1)
    torch.manual_seed(1)
    other = DDP(nn.Linear(4, 3).to(device()))
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)
    with CheckpointManager(root, {"model": other, "optim": other_opt}, distributed=DistributedOptions(timeout_secs=30)) as mgr:
        assert mgr.restore_latest() == 1
    return all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters())) and torch.equal(
        opt.state[model.module.weight]["momentum_buffer"], other_opt.state[other.module.weight]["momentum_buffer"])


def test_ddp_prefix_never_reaches_files(tmp_path: Path) -> None:
    assert run_distributed(ddp_round_trip, 2, str(tmp_path)) == [True, True]
    weights = torch.load(tmp_path / "step-000000001" / "Linear.0.1.pt", weights_only=True)
    assert sorted(weights) == ["bias", "weight"]
    plain = nn.Linear(4, 3)
    with CheckpointManager(tmp_path, {"model": plain, "optim": torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)}) as mgr:
        assert mgr.restore_latest() == 1
    assert torch.equal(plain.weight, weights["weight"])
