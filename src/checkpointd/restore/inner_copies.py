"""Restore a stored tensor subclass into the live one: its inner tensors copied in place, or a rebuild.

Why not the subclass's own ``copy_`` (what ``load_state_dict`` does): for some classes (TransformerEngine's
quantized tensors) it re-quantizes the source, which is not bit-exact, and it copies one tensor at a
time. Copying the *inner* tensors (quantized data, scales, ...) keeps every bit and lets the bulk copy
(:mod:`checkpointd.restore.bulkcopy`) take them with the plain tensors, CPU and CUDA alike; the live
objects and their inner storages stay the same (optimizers, module attributes and compiled graphs
keep their references).

When the live object cannot take the stored inner tensors in place (other inner names, shapes or
dtypes, or another flatten context: the quantization config changed), an accepted class
(:func:`checkpointd.format.subclasses.accepted_class`) is rebuilt from the stored inner tensors with its
own ``__tensor_unflatten__`` and swapped into the live Python object (``torch.utils.swap_tensors``), and
the restore says so in the log; any other class is refused.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import torch

from checkpointd.errors import StateMismatchError
from checkpointd.format.subclasses import accepted_class, is_stored_subclass, qualname

logger = logging.getLogger("checkpointd")

Pair = tuple[torch.Tensor, torch.Tensor]


class NotInPlace(Exception):
    """The live subclass cannot take the stored inner tensors in place (the reason is the message)."""


def subclass_copies(live: torch.Tensor, stored: Any, where: str) -> tuple[list[Pair], Callable[[], None] | None]:
    """``(inner (dst, src) pairs, rebuild or None)`` restoring the stored subclass into ``live``.

    Planning only: nothing changes until the caller copies the pairs or calls the rebuild.

    Raises:
        StateMismatchError: another class, outer shape or dtype, or a rebuild a class not accepted needs.
    """
    if type(stored) is not type(live):
        got = qualname(type(stored)) if isinstance(stored, torch.Tensor) and is_stored_subclass(stored) else (
            "a plain tensor" if isinstance(stored, torch.Tensor) else type(stored).__name__)
        raise StateMismatchError(f"{where}: the live tensor is a {qualname(type(live))}, the checkpoint holds {got}; "
                                 "build the model with the same quantization that was saved")
    if tuple(live.shape) != tuple(stored.shape) or live.dtype != stored.dtype:
        raise StateMismatchError(f"{where}: live {type(live).__name__} of shape {tuple(live.shape)} and dtype {live.dtype}, "
                                 f"saved {tuple(stored.shape)} {stored.dtype}")
    try:
        return inner_pairs(live, stored, where), None
    except NotInPlace as why:
        return [], _rebuild(live, stored, where, str(why))


def inner_pairs(live: torch.Tensor, stored: torch.Tensor, where: str) -> list[Pair]:
    """The (live inner, stored inner) pairs, nested subclasses flattened; raises :class:`NotInPlace`."""
    names, ctx = live.__tensor_flatten__()
    s_names, s_ctx = stored.__tensor_flatten__()
    if list(names) != list(s_names):
        raise NotInPlace(f"inner tensors {list(s_names)} saved, {list(names)} live")
    if comparable(ctx) != comparable(s_ctx):
        raise NotInPlace("its flatten context (quantization config) differs")
    out: list[Pair] = []
    for n in names:
        d, s = getattr(live, n), getattr(stored, n)
        if is_stored_subclass(d) or is_stored_subclass(s):
            if type(d) is not type(s) or tuple(d.shape) != tuple(s.shape) or d.dtype != s.dtype:
                raise NotInPlace(f"inner {n!r} is a {type(s).__name__} saved, a {type(d).__name__} live")
            out += inner_pairs(d, s, f"{where}.{n}")
        elif tuple(d.shape) != tuple(s.shape) or d.dtype != s.dtype:
            raise NotInPlace(f"inner {n!r}: saved {tuple(s.shape)} {s.dtype}, live {tuple(d.shape)} {d.dtype}")
        else:
            out.append((d.detach(), s))
    return out


def comparable(ctx: Any, depth: int = 0) -> Any:
    """A flatten context with devices left out (NF4 records its device; a restore may change it)."""
    if depth > 20:
        return ctx
    if isinstance(ctx, torch.device):
        return "<device>"
    if isinstance(ctx, dict):
        return {k: comparable(v, depth + 1) for k, v in ctx.items()}
    if isinstance(ctx, (list, tuple)) and not isinstance(ctx, torch.Size):
        return (type(ctx).__name__, tuple(comparable(v, depth + 1) for v in ctx))
    if dataclasses.is_dataclass(ctx) and not isinstance(ctx, type):
        return (type(ctx), tuple(comparable(getattr(ctx, f.name), depth + 1) for f in dataclasses.fields(ctx)))
    return ctx


def on_device(ctx: Any, device: torch.device, depth: int = 0) -> Any:
    """A flatten context with every ``torch.device`` in it replaced by ``device``."""
    if depth > 20:
        return ctx
    if isinstance(ctx, torch.device):
        return device
    if isinstance(ctx, dict):
        return type(ctx)((k, on_device(v, device, depth + 1)) for k, v in ctx.items())
    if isinstance(ctx, tuple) and hasattr(ctx, "_fields"):
        return type(ctx)(*(on_device(v, device, depth + 1) for v in ctx))
    if isinstance(ctx, (list, tuple)) and not isinstance(ctx, torch.Size):
        return type(ctx)(on_device(v, device, depth + 1) for v in ctx)
    if dataclasses.is_dataclass(ctx) and not isinstance(ctx, type):
        changes = {f.name: on_device(getattr(ctx, f.name), device, depth + 1) for f in dataclasses.fields(ctx) if f.init}
        return dataclasses.replace(ctx, **changes)
    return ctx


def _rebuild(live: torch.Tensor, stored: torch.Tensor, where: str, why: str) -> Callable[[], None]:
    """A step that rebuilds the stored subclass on the live device and swaps it into the live object."""
    cls = type(live)
    if accepted_class(qualname(cls)) is not cls:
        raise StateMismatchError(f"{where}: the live {qualname(cls)} cannot take the saved one in place ({why}), and "
                                 "checkpointd rebuilds only accepted classes (checkpointd.allow_tensor_subclasses)")
    names, ctx = stored.__tensor_flatten__()
    inner = {n: getattr(stored, n).to(live.device) for n in names}
    new = cls.__tensor_unflatten__(inner, on_device(ctx, live.device), live.size(), live.stride())
    if new.requires_grad != live.requires_grad:
        new.requires_grad_(live.requires_grad)
    for k, v in live.__dict__.items():  # attributes the rebuild does not set (nn.Parameter's _is_param)
        if k not in new.__dict__ and not isinstance(v, torch.Tensor):
            setattr(new, k, v)

    def swap() -> None:
        torch.utils.swap_tensors(live, new)
        logger.info("%s: rebuilt %s (%s), not restored in place", where, cls.__name__, why)

    return swap


__all__ = ["NotInPlace", "comparable", "inner_pairs", "on_device", "subclass_copies"]
