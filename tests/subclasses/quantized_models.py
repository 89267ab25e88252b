"""Tiny models with torchao's quantized tensors.

Shared by the tests of ``tests/subclasses`` and by ``qlora_worker.py`` (run in a child process):
Int8 weight-only (``Int8Tensor``), Float8 weight-only on bf16 (``Float8Tensor``), QLoRA (frozen
``NF4Tensor`` bases, trained LoRA adapters) and float8 training with the FSDP float8 all-gather wrapper
(``WeightWithDynamicFloat8CastTensor``), all on CPU.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
import torchao  # noqa: F401 - registers torchao's classes as torch safe globals
from torch import nn
from torchao.float8 import Float8LinearConfig, convert_to_float8_training
from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig, quantize_
from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4, to_nf4

warnings.filterwarnings("ignore", message=".*KernelPreference.*")


def int8_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8))
    quantize_(m, Int8WeightOnlyConfig())
    return m


def float8_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(64, 32, dtype=torch.bfloat16))
    quantize_(m, Float8WeightOnlyConfig())
    return m


class LoRALinear(nn.Module):
    """A frozen NF4 base weight plus a trained low-rank update (QLoRA)."""

    def __init__(self, out_features: int, in_features: int, rank: int = 4) -> None:
        super().__init__()
        base = torch.randn(out_features, in_features, dtype=torch.bfloat16)
        self.weight = nn.Parameter(to_nf4(base), requires_grad=False)
        self.lora_a = nn.Parameter(torch.randn(rank, in_features, dtype=torch.bfloat16) * 0.01)
        self.lora_b = nn.Parameter(torch.randn(out_features, rank, dtype=torch.bfloat16) * 0.01)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_nf4(x, self.weight) + (x @ self.lora_a.t()) @ self.lora_b.t()


def qlora_model(seed: int) -> nn.Module:
    """Two NF4 layers (numel/64 must be a multiple of 256: 128x256)."""
    torch.manual_seed(seed)
    return nn.Sequential(LoRALinear(128, 256), LoRALinear(256, 128))


def float8_training_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    convert_to_float8_training(m, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    return m


def train_steps(model: nn.Module, opt: torch.optim.Optimizer, steps: range, in_features: int,
                dtype: torch.dtype = torch.float32, after_step: Callable[[int], Any] | None = None) -> None:
    """Deterministic steps: the batch of step ``s`` depends only on ``s``."""
    for s in steps:
        g = torch.Generator().manual_seed(1000 + s)
        x = torch.randn(8, in_features, generator=g).to(dtype)
        loss = model(x).float().pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if after_step is not None:
            after_step(s)


def bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes (float8 dtypes have no torch.equal on CPU)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def inner(t: torch.Tensor) -> dict[str, torch.Tensor]:
    """A subclass's inner tensors by name (plain tensors: itself)."""
    if type(t) in (torch.Tensor, nn.Parameter):
        return {"": t}
    names, _ = t.__tensor_flatten__()
    return {n: getattr(t, n) for n in names}


def assert_bit_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Two state dicts hold the same classes, flatten contexts and bytes."""
    assert a.keys() == b.keys()
    for k in a:
        x, y = a[k], b[k]
        assert type(x) is type(y), k
        if not isinstance(x, torch.Tensor):
            assert x == y, k
            continue
        if type(x) not in (torch.Tensor, nn.Parameter):
            assert x.__tensor_flatten__()[1] == y.__tensor_flatten__()[1], k
        ix, iy = inner(x), inner(y)
        assert ix.keys() == iy.keys(), k
        for n in ix:
            assert ix[n].dtype == iy[n].dtype and ix[n].shape == iy[n].shape, (k, n)
            assert torch.equal(bits(ix[n]), bits(iy[n])), (k, n)


def optimizer_bits(opt: torch.optim.Optimizer) -> dict[str, Any]:
    """An optimizer's state as a flat comparable dict."""
    sd = opt.state_dict()
    return {f"{pid}.{k}": v for pid, st in sd["state"].items() for k, v in st.items()}


def run_qlora(model: nn.Module, opt: torch.optim.Optimizer, steps: range, after_step: Callable[[int], Any] | None = None) -> None:
    """QLoRA training steps (inputs of 256 bf16 features)."""
    train_steps(model, opt, steps, 256, torch.bfloat16, after_step)


def restore_in_place(root: Any, saved: nn.Module, opt_saved: torch.optim.Optimizer, fresh: nn.Module,
                     opt_fresh: torch.optim.Optimizer, step: int, **save_options: Any) -> None:
    """Save ``saved`` at ``step`` with ``save_options``, restore into ``fresh``: the live parameter objects
    and their inner storages take the values, bit for bit, optimizer state included."""
    from checkpointd import CheckpointManager

    with CheckpointManager(root, {"model": saved, "opt": opt_saved}, **save_options) as mgr:
        mgr.save(step)
    before = identities(fresh)
    with CheckpointManager(root, {"model": fresh, "opt": opt_fresh}) as mgr:
        assert mgr.restore_latest() == step
    assert identities(fresh) == before
    assert_bit_equal(saved.state_dict(), fresh.state_dict())
    assert_bit_equal(optimizer_bits(opt_saved), optimizer_bits(opt_fresh))


def identities(model: nn.Module) -> dict[str, Any]:
    """Each parameter's Python object and its inner tensors' data pointers."""
    return {k: (id(p), {n: t.data_ptr() for n, t in inner(p).items()}) for k, p in model.named_parameters()}
