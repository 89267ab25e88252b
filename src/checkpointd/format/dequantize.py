"""Plain high-precision copies of stored tensor subclasses, for inspection and export (not bit-exact).

``checkpointd.load(..., dequantize=True)`` turns every tensor subclass in a loaded checkpoint (torchao's
quantized tensors) into a plain tensor with the class's own math. The values are what the class's
``dequantize()`` gives, not the stored bits: restoring training goes through the subclasses themselves.
A class without a built-in rule and without a ``dequantize()`` taking no arguments needs
:func:`register_dequantizer`.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from checkpointd.errors import ConfigError
from checkpointd.format.subclasses import is_stored_subclass, qualname

Dequantizer = Callable[[torch.Tensor], torch.Tensor]

DEQUANTIZERS: dict[str, Dequantizer] = {
    "torchao.quantization.Int8Tensor": lambda t: t.dequantize(),
    "torchao.quantization.Float8Tensor": lambda t: t.dequantize(),
    # NF4Tensor.dequantize is a static helper taking the codes; get_original_weight is the whole tensor
    "torchao.quantization.quantize_.workflows.nf4.nf4_tensor.NF4Tensor": lambda t: t.get_original_weight(),
    "torchao.float8.float8_training_tensor.Float8TrainingTensor": lambda t: t.to_original_precision(),
    # its inner tensor is the high-precision master weight itself: this one is exact
    "torchao.float8.fsdp_utils.WeightWithDynamicFloat8CastTensor": lambda t: t._tensor.detach(),
    "torchao.optim.subclass_8bit.OptimState8bit": lambda t: t.dequantize(),
    "torchao.optim.subclass_4bit.OptimState4bit": lambda t: t.dequantize(),
    "torchao.optim.subclass_fp8.OptimStateFp8": lambda t: t.dequantize(),
}
"""How each class becomes a plain tensor, by qualified class name."""


def register_dequantizer(cls: type, fn: Dequantizer) -> None:
    """Use ``fn(tensor) -> plain tensor`` for ``cls`` in ``load(..., dequantize=True)``."""
    DEQUANTIZERS[qualname(cls)] = fn


def dequantize_tree(obj: Any, path: tuple[str, ...] = (), done: dict[str, str] | None = None) -> Any:
    """``obj`` with every tensor subclass replaced by a plain tensor; ``done`` gets ``{key path: class}``.

    Raises:
        ConfigError: a class with no rule and no argument-free ``dequantize()``.
    """
    done = {} if done is None else done
    if isinstance(obj, torch.Tensor):
        return _plain(obj, "/".join(path), done) if is_stored_subclass(obj) else obj
    if isinstance(obj, dict):
        return type(obj)((k, dequantize_tree(v, path + (str(k),), done)) for k, v in obj.items())
    if isinstance(obj, list):
        return [dequantize_tree(v, path + (str(i),), done) for i, v in enumerate(obj)]
    if isinstance(obj, tuple) and not isinstance(obj, torch.Size):
        return tuple(dequantize_tree(v, path + (str(i),), done) for i, v in enumerate(obj))
    return obj


def _plain(t: torch.Tensor, where: str, done: dict[str, str]) -> torch.Tensor:
    name = qualname(type(t))
    fn = DEQUANTIZERS.get(name)
    try:
        out = fn(t) if fn is not None else t.dequantize()
    except TypeError as exc:
        raise ConfigError(f"key {where!r} holds a {name}, which checkpointd cannot dequantize ({exc}); register a "
                          "function with checkpointd.register_dequantizer, or load it with dequantize=False") from exc
    if not isinstance(out, torch.Tensor) or is_stored_subclass(out):
        raise ConfigError(f"key {where!r}: dequantizing a {name} gave a {type(out).__name__}, not a plain tensor; "
                          "register a function with checkpointd.register_dequantizer")
    done[where] = name
    return out.detach()


def not_exact_warning(done: dict[str, str], what: str) -> str:
    """The warning for ``done`` (path -> class) values that ``what`` gave as plain dequantized tensors."""
    keys = ", ".join(f"{k!r} ({c.rpartition('.')[2]})" for k, c in list(done.items())[:8])
    return (f"checkpointd: {what} gave {len(done)} tensor subclass value(s) as plain dequantized tensors, which "
            f"are not bit-exact copies of the saved values: {keys}" + (" and more" if len(done) > 8 else ""))


__all__ = ["DEQUANTIZERS", "Dequantizer", "dequantize_tree", "not_exact_warning", "register_dequantizer"]
