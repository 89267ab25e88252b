"""The model and training step the CUDA tests share."""

from __future__ import annotations

import torch
import torch.nn as nn


def big_model(width: int = 4096, depth: int = 8) -> nn.Module:
    """~0.5 GB of fp32 parameters (+1 GB of AdamW state): large enough that the device-to-host copies
    are still in flight after ``maybe_save`` returns. A BatchNorm first, for buffers the forward updates."""
    layers: list[nn.Module] = [nn.BatchNorm1d(width)]
    for _ in range(depth):
        layers.append(nn.Linear(width, width))
    return nn.Sequential(*layers).cuda()


def train_step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    x = torch.randn(64, model[0].num_features, device="cuda")
    loss = model(x).square().mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def scaled_cnn(channels: int, spatial: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer, torch.amp.GradScaler]:
    """A channels_last CNN with fused AdamW and a CUDA GradScaler: the layouts and device scalars that
    a resume must bring back bit-exactly. Inputs are ``(8, 4, spatial, spatial)``."""
    torch.manual_seed(seed)
    side = spatial - 2
    m = nn.Sequential(nn.Conv2d(4, channels, 3), nn.BatchNorm2d(channels), nn.Flatten(),
                      nn.Linear(channels * side * side, 256 if channels >= 64 else 3)).cuda()
    m = m.to(memory_format=torch.channels_last)
    o = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)
    sc = torch.amp.GradScaler("cuda", init_scale=2.0**10)
    return m, o, sc


def run_scaled(m: nn.Module, o: torch.optim.Optimizer, sc: torch.amp.GradScaler, steps: int,
               gen: torch.Generator, spatial: int) -> None:
    """``steps`` bf16-autocast steps of :func:`scaled_cnn`'s model on inputs drawn from ``gen``."""
    for _ in range(steps):
        x = torch.randn(8, 4, spatial, spatial, device="cuda", generator=gen).to(memory_format=torch.channels_last)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = m(x).float().square().mean()
        o.zero_grad(set_to_none=True)
        sc.scale(loss).backward()
        sc.step(o)
        sc.update()
