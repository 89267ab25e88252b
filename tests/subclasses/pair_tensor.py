"""A minimal traceable wrapper tensor subclass that no library accepts (torch only, no torchao).

Kept in a module of its own so that a child process can load a checkpoint holding it without
having imported it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map_only


class PairTensor(torch.Tensor):
    """Two inner tensors and a tag; operations act on the first."""

    @staticmethod
    def __new__(cls, a: torch.Tensor, b: torch.Tensor, tag: str = "pair") -> "PairTensor":
        return torch.Tensor._make_wrapper_subclass(cls, a.shape, dtype=a.dtype, device=a.device)

    def __init__(self, a: torch.Tensor, b: torch.Tensor, tag: str = "pair") -> None:
        self.a, self.b, self.tag = a, b, tag

    def __tensor_flatten__(self) -> tuple[list[str], dict[str, Any]]:
        return ["a", "b"], {"tag": self.tag}

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], ctx: dict[str, Any], size: Any, stride: Any) -> "PairTensor":
        return PairTensor(inner["a"], inner["b"], ctx["tag"])

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten.detach.default:
            (t,) = args
            return PairTensor(t.a.detach(), t.b.detach(), t.tag)
        unwrap = tree_map_only(PairTensor, lambda t: t.a, (args, kwargs or {}))
        return func(*unwrap[0], **unwrap[1])


def pair_module(seed: int) -> torch.nn.Module:
    """A Linear with a PairTensor buffer."""
    torch.manual_seed(seed)
    m = torch.nn.Linear(4, 4)
    m.register_buffer("pair", PairTensor(torch.randn(4, 4), torch.randint(0, 9, (4,), dtype=torch.int32)))
    return m
