"""Apply verified stored values to the live objects in bulk: copies first, all at once, then the rest.

Why: ``Module.load_state_dict`` copies one tensor at a time (a synchronous pageable H2D copy each) and
``Optimizer.load_state_dict`` *replaces* every state tensor with ``value.to(param.device)``: a fresh
GPU allocation and another lone pageable copy per tensor. For a multi-GB state that is most of a
restore. Here:

- modules whose loading is plain (``nn.Module``'s own ``_load_from_state_dict``, BatchNorm's, no hooks,
  no extra state) get their stored tensors copied straight into the live parameters and buffers,
  which keep their dtype, device and strides (channels_last stays channels_last);
- optimizers that use ``Optimizer.load_state_dict`` unchanged and have no load pre-hooks get each
  per-parameter state tensor placed on the device *before* torch sees it: the tensor torch would make
  (``Optimizer._process_value_according_to_param_policy``: floating state in the parameter's dtype on its
  device, ``step`` float32 on the device for fused/capturable and left alone otherwise; then
  :func:`checkpointd.restore.per_entry.match_optimizer_state_layout`'s strides) is the live optimizer's existing
  state tensor when that already has exactly this shape, dtype, device and strides (copied in place),
  else a new one allocated with them. Torch's own ``load_state_dict`` then runs on those tensors (its
  ``.to()`` is a no-op for them), so param groups, hooks and ``__setstate__`` stay torch's;
- tensor subclasses (torchao's quantized tensors) of such modules and tensor entries get their inner
  tensors copied in place (:mod:`checkpointd.restore.inner_copies`), or are rebuilt and swapped in;
- all those copies go through :func:`checkpointd.restore.bulkcopy.copy_pairs` together.

Everything else (schedulers, plain data, custom modules/optimizers, unusual tensors) takes
:func:`checkpointd.restore.per_entry.apply_entry`, the per-entry path. Planning touches nothing; live
tensors change only once every entry has been planned, so an entry that cannot be planned changes nothing.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Mapping, TypeGuard

import torch
from torch import nn

from checkpointd.format.subclasses import is_stored_subclass
from checkpointd.restore import bulkcopy, device_image
from checkpointd.restore.inner_copies import subclass_copies
from checkpointd.restore.per_entry import KeySubset, apply_entry, match_optimizer_state_layout
from checkpointd.state import Entry, unwrap_module

logger = logging.getLogger("checkpointd")

_SMALL_ALIAS_BYTES = 64 << 10
PLACE_ON_CPU = False
"""Also place state of CPU parameters (tests set it to run the placement logic without a GPU). Off by
default: on CPU, torch's ``.to()`` keeps the stored tensor itself, which costs nothing."""


def apply_entries(entries: list[Entry], values: Mapping[str, Any]) -> None:
    """Load ``values[e.name]`` into every entry, in place (after ``per_entry.fit_values``; a module's
    :class:`~checkpointd.restore.per_entry.KeySubset` loads its keys only)."""
    pairs: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = {}
    finish: list[Callable[[], None]] = []
    for e in entries:
        value = values[e.name]
        step: Callable[[], None] | None = None
        try:
            if e.kind == "module":
                step = _plan_module(e.obj, value, pairs)
            elif e.kind == "optimizer":
                step = _plan_optimizer(e.obj, value, pairs)
            elif e.kind == "tensor":
                step = _plan_tensor(e.obj, value, pairs)
        except _NotPlain as why:
            logger.debug("state[%r]: per-entry restore (%s)", e.name, why)
            step = None
        finish.append(step if step is not None else functools.partial(_apply_entry, e, value))
    bulkcopy.copy_pairs(list(pairs.values()))
    for fn in finish:
        fn()


def _apply_entry(e: Entry, value: Any) -> None:
    device_image.ensure_host(value)  # the per-entry path reads the stored values on the host
    apply_entry(e, value)


class _NotPlain(Exception):
    """This entry takes the per-entry path (the reason is logged at debug level)."""


def _done() -> None:
    pass


def _add(pairs: dict, dst: torch.Tensor, src: torch.Tensor) -> None:
    """One copy; a later copy into the same memory replaces an earlier one (tied weights: last wins)."""
    key = (dst.device, dst.data_ptr(), dst.dtype, tuple(dst.shape), dst.stride())
    pairs.pop(key, None)
    pairs[key] = (dst, src)


def _plain_tensor(t: Any) -> TypeGuard[torch.Tensor]:
    return (isinstance(t, torch.Tensor) and type(t) in (torch.Tensor, nn.Parameter) and t.layout == torch.strided
            and not t.is_meta and not t.is_quantized and not t.is_nested)


# -- modules ----------------------------------------------------------------------------------------

def _plain_loaders() -> tuple[Any, ...]:
    out: list[Any] = [nn.Module._load_from_state_dict]
    try:
        from torch.nn.modules.batchnorm import _NormBase

        out.append(_NormBase._load_from_state_dict)  # adds num_batches_tracked only when it is missing
    except ImportError:  # pragma: no cover - older/newer torch
        pass
    return tuple(out)


def _module_is_plain(module: nn.Module) -> str | None:
    """None if ``load_state_dict`` of this module is exactly a ``copy_`` per key; else why not."""
    if type(module).load_state_dict is not nn.Module.load_state_dict:
        return "load_state_dict is overridden"
    future = getattr(torch, "__future__", None)
    if future is not None and getattr(future, "get_swap_module_params_on_conversion", lambda: False)():
        return "swap_module_params_on_conversion is set"
    loaders = _plain_loaders()
    for sub in module.modules():
        cls = type(sub)
        if cls._load_from_state_dict not in loaders:
            return f"{cls.__name__} has its own _load_from_state_dict"
        if cls.get_extra_state is not nn.Module.get_extra_state or cls.set_extra_state is not nn.Module.set_extra_state:
            return f"{cls.__name__} has extra state"
        if cls.state_dict is not nn.Module.state_dict or cls._save_to_state_dict is not nn.Module._save_to_state_dict:
            return f"{cls.__name__} customises state_dict"
        for hooks in ("_load_state_dict_pre_hooks", "_load_state_dict_post_hooks", "_state_dict_hooks", "_state_dict_pre_hooks"):
            if getattr(sub, hooks, None):
                return f"{cls.__name__} has {hooks}"
    return None


def _plan_module(obj: nn.Module, value: Any, pairs: dict) -> Callable[[], None]:
    module = unwrap_module(obj)
    why = _module_is_plain(module)
    if why:
        raise _NotPlain(why)
    if not isinstance(value, Mapping):
        raise _NotPlain("stored value is not a mapping")
    live = module.state_dict(keep_vars=True)
    if isinstance(value, KeySubset):  # a non-strict restore: these keys only, the module's others stay
        if not set(value) <= set(live):
            raise _NotPlain("keys the module lacks")
    elif set(live) != set(value):
        raise _NotPlain("keys differ")
    mine: list[tuple[torch.Tensor, torch.Tensor]] = []
    rebuilds: list[Callable[[], None]] = []
    for k, t in live.items():
        if k not in value:
            continue  # KeySubset: left as it is
        v = value[k]
        if is_stored_subclass(t):  # a quantized tensor: its inner tensors, in place (or a rebuild)
            inner, rebuild = subclass_copies(t, v, f"key {k!r}")
            mine += inner
            rebuilds += [rebuild] if rebuild is not None else []
            continue
        if not (_plain_tensor(t) and _plain_tensor(v)) or t.shape != v.shape or torch.nn.parameter.is_lazy(t):
            raise _NotPlain(f"key {k!r} is not a plain tensor of the live shape")
        mine.append((t.detach(), v))
    for dst, src in mine:
        _add(pairs, dst, src)
    return functools.partial(_run_all, rebuilds) if rebuilds else _done


def _run_all(steps: list[Callable[[], None]]) -> None:
    for fn in steps:
        fn()


def _plan_tensor(obj: torch.Tensor, value: Any, pairs: dict) -> Callable[[], None]:
    if is_stored_subclass(obj):
        inner, rebuild = subclass_copies(obj, value, "tensor")
        for dst, src in inner:
            _add(pairs, dst, src)
        return rebuild or _done
    if not (_plain_tensor(obj) and _plain_tensor(value)) or obj.shape != value.shape:
        raise _NotPlain("not a plain tensor of the live shape")
    _add(pairs, obj.detach(), value)
    return _done


# -- optimizers -------------------------------------------------------------------------------------

def _plan_optimizer(opt: torch.optim.Optimizer, value: Any, pairs: dict) -> Callable[[], None]:
    """Place every stored per-parameter state tensor where torch would put it; torch loads the rest."""
    if type(opt).load_state_dict is not torch.optim.Optimizer.load_state_dict:
        raise _NotPlain("load_state_dict is overridden")
    if getattr(opt, "_optimizer_load_state_dict_pre_hooks", None):
        raise _NotPlain("load_state_dict pre-hooks")
    if not isinstance(value, Mapping) or not isinstance(value.get("state"), Mapping) or not isinstance(value.get("param_groups"), list):
        raise _NotPlain("not an optimizer state dict")
    saved_groups = value["param_groups"]
    groups = opt.param_groups
    if len(groups) != len(saved_groups) or any(len(g["params"]) != len(s.get("params", ())) for g, s in zip(groups, saved_groups)):
        raise _NotPlain("parameter groups differ (torch gives the error)")
    id_map: dict[Any, torch.Tensor] = {}
    flags: dict[Any, bool] = {}
    for g, s in zip(groups, saved_groups):
        special = bool(s.get("fused", False) or s.get("capturable", False))
        for pid, p in zip(s["params"], g["params"]):
            id_map[pid] = p
            flags.setdefault(pid, special)  # torch takes the first saved group listing the id
    new_state: dict[Any, Any] = {}
    mine: list[tuple[torch.Tensor, torch.Tensor]] = []
    reused: set[int] = set()
    for pid, st in value["state"].items():
        p = id_map.get(pid)
        if p is None or not isinstance(st, Mapping):
            new_state[pid] = st
            continue
        out = dict(st)
        for key, v in st.items():
            if not isinstance(v, torch.Tensor):
                continue
            placed = _place_state(p, v, key, flags[pid], opt.state.get(p), reused)
            if placed is None:
                continue
            tensor, fill = placed
            if fill:
                mine.append((tensor, v))
            out[key] = tensor
        new_state[pid] = out
    for dst, src in mine:
        _add(pairs, dst, src)
    placed_sd = dict(value)
    placed_sd["state"] = new_state

    def finish() -> None:
        device_image.ensure_host(placed_sd)  # what was not placed (steps, CPU parameters' state) torch reads
        opt.load_state_dict(placed_sd)
        match_optimizer_state_layout(opt)

    return finish


def _place_state(p: torch.Tensor, v: torch.Tensor, key: Any, fused_or_capturable: bool, live_state: Any,
                 reused: set[int]) -> tuple[torch.Tensor, bool] | None:
    """``(tensor to hand torch for state key of p, whether it must be filled from v)``; None: hand ``v``.

    ``reused`` holds the ids of live state tensors already taken (each is reused at most once).
    """
    if not _plain_tensor(v) or not _plain_tensor(p):
        return None
    if key == "step" and not fused_or_capturable:
        # torch keeps it as stored; a small CPU view would keep the whole read buffer alive
        if v.device.type == "cpu" and v.nbytes <= _SMALL_ALIAS_BYTES and v.untyped_storage().nbytes() > 2 * _SMALL_ALIAS_BYTES:
            device_image.ensure_host(v)
            return v.clone(), False
        return None
    if v.device.type != "cpu" or (p.device.type == "cpu" and not PLACE_ON_CPU):
        return None  # same device: torch's .to() keeps v (no copy to save)
    if key == "step":
        dtype = torch.float32
    else:
        dtype = p.dtype if p.is_floating_point() else v.dtype
    device = p.device
    like = torch.empty_like(v, dtype=dtype, device="meta")  # the strides .to() gives (preserve_format)
    strides = like.stride()
    if v.dim() > 0 and v.shape == p.shape and strides != p.stride():  # match_optimizer_state_layout
        if not bulkcopy.is_dense(p):
            return None
        strides = p.stride()
    existing = live_state.get(key) if isinstance(live_state, Mapping) else None
    if (_plain_tensor(existing) and existing.shape == v.shape and existing.dtype == dtype and existing.device == device
            and existing.stride() == strides and not existing.requires_grad and bulkcopy.is_dense(existing)
            and id(existing) not in reused):
        reused.add(id(existing))
        return existing, True
    return torch.empty_strided(tuple(v.shape), strides, dtype=dtype, device=device), True


__all__ = ["apply_entries"]
