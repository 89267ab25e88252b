"""The per-entry restore path: check that live objects can take stored values, then load each entry.

:func:`check_compatible` refuses a step before anything is touched when a live module, optimizer,
tensor or data entry cannot take its stored value. :func:`apply_entry` loads one value the way the
object's own ``load_state_dict`` (or ``copy_``) does; the bulk apply
(:mod:`checkpointd.restore.apply`) falls back to it for every entry it cannot plan.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from checkpointd.errors import StateMismatchError
from checkpointd.state import Entry, unwrap_module


def check_compatible(entries: list[Entry], values: Mapping[str, Any], step: int,
                     saved_classes: Mapping[str, str | None] | None = None) -> None:
    """Refuse before touching anything when the live state cannot take the stored values.

    ``saved_classes``: the class each entry had when saved (the manifest's ``class_name``): an
    optimizer, scheduler, scaler or other stateful object of another class is refused.
    """
    for e in entries:
        if e.name not in values:
            raise StateMismatchError(
                f"checkpoint step {step} has no entry {e.name!r} (it holds {sorted(values)}); "
                "register the same state names that were saved"
            )
        v = values[e.name]
        saved = (saved_classes or {}).get(e.name)
        if saved and e.kind in ("optimizer", "scheduler", "scaler", "stateful") and saved != type(e.obj).__name__:
            raise StateMismatchError(
                f"state[{e.name!r}] is a {type(e.obj).__name__}, but step {step} saved a {saved}; "
                f"build a {saved} to resume from this checkpoint (its state does not fit a {type(e.obj).__name__})"
            )
        if e.kind == "module":
            live = unwrap_module(e.obj).state_dict()
            missing = sorted(set(live) - set(v))
            extra = sorted(set(v) - set(live))
            if missing or extra:
                raise StateMismatchError(
                    f"state[{e.name!r}] ({type(e.obj).__name__}) does not match step {step}: "
                    f"missing keys {missing[:5]}, unexpected keys {extra[:5]}"
                )
            for k, t in live.items():
                if isinstance(t, torch.Tensor) and isinstance(v[k], torch.Tensor) and t.shape != v[k].shape:
                    raise StateMismatchError(
                        f"state[{e.name!r}] key {k!r}: live shape {tuple(t.shape)}, saved {tuple(v[k].shape)} at step {step}"
                    )
        elif e.kind == "optimizer":
            live_sizes = [len(g["params"]) for g in e.obj.param_groups]
            groups = v.get("param_groups") if isinstance(v, dict) else None
            saved_sizes = [len(g.get("params", ())) for g in groups] if isinstance(groups, list) else None
            if saved_sizes != live_sizes:
                raise StateMismatchError(
                    f"state[{e.name!r}] ({type(e.obj).__name__}): live parameter groups of sizes {live_sizes}, "
                    f"saved {saved_sizes} at step {step}; build the optimizer over the same parameters that were saved"
                )
        elif e.kind == "tensor":
            if not isinstance(v, torch.Tensor) or v.shape != e.obj.shape:
                got = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
                raise StateMismatchError(f"state[{e.name!r}]: live tensor shape {tuple(e.obj.shape)}, saved {got} at step {step}")
        elif e.kind == "data":
            if type(v) is not type(e.obj) and not (isinstance(v, dict) and isinstance(e.obj, dict)):
                raise StateMismatchError(f"state[{e.name!r}]: live {type(e.obj).__name__}, saved {type(v).__name__} at step {step}")


def apply_entry(e: Entry, value: Any) -> None:
    """Load one stored value into its live object, in place."""
    if e.kind == "module":
        unwrap_module(e.obj).load_state_dict(value, strict=True)
    elif e.kind == "optimizer":
        e.obj.load_state_dict(value)
        match_optimizer_state_layout(e.obj)
    elif e.kind in ("scheduler", "scaler", "stateful"):
        e.obj.load_state_dict(value)
    elif e.kind == "tensor":
        with torch.no_grad():
            e.obj.copy_(value)
    elif e.kind == "data":
        value = _onto_live_devices(e.obj, value)
        if isinstance(e.obj, dict):
            e.obj.clear()
            e.obj.update(value)
        else:
            e.obj[:] = value


def _onto_live_devices(live: Any, saved: Any) -> Any:
    """Saved plain data with each tensor moved to where the live tensor at the same place lives.

    Tensors in registered dicts/lists load as CPU tensors; a live CUDA tensor under the same key gets
    its value back on its own device, dtype and memory format (copied into a tensor like it).
    """
    if isinstance(saved, torch.Tensor) and isinstance(live, torch.Tensor):
        if live.shape == saved.shape and (live.device != saved.device or live.dtype != saved.dtype or live.stride() != saved.stride()):
            out = torch.empty_like(live)
            out.copy_(saved)
            return out
        return saved
    if isinstance(saved, dict) and isinstance(live, dict):
        return type(saved)((k, _onto_live_devices(live[k], v) if k in live else v) for k, v in saved.items())
    if isinstance(saved, list) and isinstance(live, list) and len(saved) == len(live):
        return [_onto_live_devices(a, b) for a, b in zip(live, saved)]
    return saved


def match_optimizer_state_layout(optimizer: torch.optim.Optimizer) -> None:
    """Give every per-parameter state tensor its parameter's strides (channels_last stays channels_last).

    ``Optimizer.load_state_dict`` keeps whatever layout the stored tensor had; fused Adam computes
    wrong moments when a channels_last parameter gets contiguous state.
    """
    with torch.no_grad():
        for group in optimizer.param_groups:
            for p in group["params"]:
                st = optimizer.state.get(p)
                if not st:
                    continue
                for k, v in list(st.items()):
                    if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape == p.shape and v.stride() != p.stride():
                        fixed = torch.empty_like(p, dtype=v.dtype, device=v.device)
                        fixed.copy_(v)
                        st[k] = fixed


__all__ = ["apply_entry", "check_compatible", "match_optimizer_state_layout"]
