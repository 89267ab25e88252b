"""Small PhysicsNeMo modules for the interop tests: a net whose __init__ takes a nested Module.

Imported in both venvs. In the PhysicsNeMo venv the classes derive from ``physicsnemo.core.Module``. In
checkpointd's venv (no PhysicsNeMo) they derive from :class:`StandInModule`, which records ``_args`` as
PhysicsNeMo's ``Module.__new__`` does: checkpointd recognises it by duck typing, and since class names
and ``__module__`` ("pn_models") are the same in both venvs, PhysicsNeMo resolves the classes of the
files checkpointd writes. ``TinyNet(encoder=TinyEncoder(act=TinyAct()))`` nests two levels, so
``args.json`` holds ``__physicsnemo.Module__.encoder`` and ``__physicsnemo.Module__.encoder.act``; the
encoder has its own checkpoint version and an ``Infinity`` argument; the conv weight is channels_last.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch


class StandInModule(torch.nn.Module):
    """Duck-typed ``physicsnemo.core.Module`` for checkpointd's venv: ``_args`` and the version only."""

    __model_checkpoint_version__ = "0.1.0"

    def __new__(cls, *args: Any, **kwargs: Any) -> "StandInModule":
        out = super().__new__(cls)
        bound = inspect.signature(cls.__init__).bind_partial(None, *args, **kwargs)
        bound.apply_defaults()
        init_args = {k: v for k, v in bound.arguments.items() if k != "self"}
        out._args = {"__name__": cls.__name__, "__module__": cls.__module__, "__args__": init_args}
        return out


try:
    from physicsnemo.core import Module
except ImportError:  # checkpointd's own venv
    Module = StandInModule  # type: ignore[misc, assignment]


class TinyAct(Module):
    """A parameter-free nested module (it still gets its own args entry)."""

    def __init__(self, slope: float = 0.1) -> None:
        super().__init__()
        self.slope = slope

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.leaky_relu(x, self.slope)


class TinyEncoder(Module):
    __model_checkpoint_version__ = "0.3.0"

    def __init__(self, act: Module, in_features: int = 4, width: int = 8, clip: float = float("inf")) -> None:
        super().__init__()
        self.act = act
        self.clip = clip
        self.lin = torch.nn.Linear(in_features, width)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.lin(x) * self.scale).clamp(max=self.clip)


class TinyNet(Module):
    def __init__(self, encoder: Module, out_features: int = 3, channels: int = 2, name: str = "tiny") -> None:
        super().__init__()
        self.encoder = encoder
        self.conv = torch.nn.Conv2d(channels, channels, 3, padding=1)
        self.head = torch.nn.Linear(encoder.lin.out_features, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def build(seed: int = 0) -> TinyNet:
    """The model every interop test uses: fixed seed, channels_last conv weight."""
    torch.manual_seed(seed)
    model = TinyNet(TinyEncoder(TinyAct(slope=0.2), width=8), out_features=3, name="tiny-net")
    model.conv.to(memory_format=torch.channels_last)
    return model


def build_plain(seed: int = 0) -> torch.nn.Module:
    """A plain torch module beside the PhysicsNeMo one (saved as .pt, not .mdlus)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


def build_training(seed: int = 0) -> tuple[TinyNet, torch.nn.Module, torch.optim.Optimizer, Any]:
    """Both models, Adam over their parameters (net first) and a StepLR, identical in both venvs."""
    net, plain = build(seed), build_plain(seed + 100)
    optimizer = torch.optim.Adam([*net.parameters(), *plain.parameters()], lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return net, plain, optimizer, scheduler
