"""torchao's low-bit optimizers (AdamW8bit, AdamW4bit, AdamWFp8): their subclass states restore bit-exactly.

Their ``exp_avg``/``exp_avg_sq`` are ``OptimState8bit``/``OptimState4bit``/``OptimStateFp8`` tensors
(codes and block scales): saved through their inner tensors, handed back to the optimizer, and training
goes on exactly as it would have.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torchao.optim import AdamW4bit, AdamW8bit, AdamWFp8

import checkpointd
from checkpointd import CheckpointManager

OPTIMIZERS = {"AdamW8bit": AdamW8bit, "AdamW4bit": AdamW4bit, "AdamWFp8": AdamWFp8}


def _trained(cls, seed: int, steps: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256))
    opt = cls(model.parameters(), lr=1e-3)
    for _ in range(steps):
        model(torch.randn(4, 256)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _inner_bytes(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = []
    for state in opt.state.values():
        for key in ("exp_avg", "exp_avg_sq"):  # small parameters keep plain states
            t = state[key]
            names = t.__tensor_flatten__()[0] if type(t) is not torch.Tensor else []
            out += [getattr(t, n).view(torch.uint8) for n in names] if names else [t.view(torch.uint8)]
    return out


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_low_bit_optimizer_state_restores_bit_exactly_and_training_continues(tmp_path: Path, name, compression) -> None:
    cls = OPTIMIZERS[name]
    saved, opt_saved = _trained(cls, 0, 3)
    fresh, opt_fresh = _trained(cls, 1, 1)
    kinds = {type(s["exp_avg"]).__name__ for s in opt_saved.state.values()}
    assert kinds == {"Tensor", cls.__name__.replace("AdamW", "OptimState")}, kinds
    with CheckpointManager(tmp_path, {"model": saved, "opt": opt_saved}, compression=compression) as mgr:
        mgr.save(3)
    with CheckpointManager(tmp_path, {"model": fresh, "opt": opt_fresh}) as mgr:
        assert mgr.restore_latest() == 3
    assert all(torch.equal(a, b) for a, b in zip(_inner_bytes(opt_saved), _inner_bytes(opt_fresh)))
    assert all(type(a[k]) is type(b[k]) for a, b in zip(opt_saved.state.values(), opt_fresh.state.values())
               for k in ("exp_avg", "exp_avg_sq"))
    x = torch.randn(4, 256)
    for model, opt in ((saved, opt_saved), (fresh, opt_fresh)):
        model(x).pow(2).mean().backward()
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(saved.parameters(), fresh.parameters()))


def test_load_dequantize_gives_plain_optimizer_moments(tmp_path: Path) -> None:
    model, opt = _trained(AdamW8bit, 0, 2)
    with CheckpointManager(tmp_path, {"model": model, "opt": opt}, compression=None) as mgr:
        mgr.save(2)
    exact = checkpointd.load(tmp_path)["opt"]["state"][0]["exp_avg"]
    with pytest.warns(UserWarning, match="not bit-exact"):
        plain = checkpointd.load(tmp_path, dequantize=True)["opt"]["state"][0]["exp_avg"]
    assert type(exact).__name__ == "OptimState8bit" and type(plain) is torch.Tensor
    assert torch.equal(plain, exact.dequantize())
