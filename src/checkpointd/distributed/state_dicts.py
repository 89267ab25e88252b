"""State dicts under torch.distributed: gather (full), local shards (sharded), and in-place loading.

Saving uses PyTorch's ``torch.distributed.checkpoint.state_dict`` APIs, so FQNs come out without
``module.`` (DDP) or ``_orig_mod.`` (torch.compile) prefixes and optimizer state is keyed by parameter
name (FQN), as PhysicsNeMo writes it under FSDP:

- full mode: ``full_state_dict=True`` (collective; ``cpu_offload`` only when parameters live on a GPU:
  FSDP1's offload path frees the storage of CPU parameters, so a second save would crash);
- sharded mode: ``full_state_dict=False`` (DTensors, no communication). FSDP1 modules are gathered
  even in sharded mode (its ShardedTensor layout is not resharded by checkpointd).

Loading goes the other way *in place*: each live tensor (or DTensor's local block) receives its values
by ``copy_``, so strides, dtype and device are the live ones and no ``broadcast_from_rank0`` path (which
permutes channels_last tensors) is involved. FSDP1 is the exception: its flat parameters are loaded
through ``set_model_state_dict``/``set_optimizer_state_dict``, after :func:`fix_fsdp1_optimizer_layout`
undoes the storage-order/logical-order mismatch that scrambles channels_last optimizer state.

An error in user code while a rank takes its state (a ``state_dict()``, a hook) is raised as a
StateError naming the entry (:func:`as_state_error`, :func:`state_failure`).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from checkpointd.errors import CheckpointError, StateError, StateMismatchError
from checkpointd.restore.per_entry import KeySubset
from checkpointd.restore.sharded_subclasses import plan_copy_into
from checkpointd.state import Entry, entry_state, unwrap_module
from checkpointd.format.sharding import ShardedLeaf, copy_into, is_dtensor, map_tree, materialize, stored_shape

_WRAPPER_PARTS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod", "_dp_wrapped_module")


def clean_fqn(name: str) -> str:
    """A parameter name without wrapper components (FSDP1, activation checkpointing, compile, DDP's leading ``module``)."""
    parts = [p for p in name.split(".") if p and p not in _WRAPPER_PARTS]
    return ".".join(parts)


def is_fsdp1(model: torch.nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    except ImportError:  # pragma: no cover
        return False
    return any(isinstance(m, FSDP) for m in model.modules())


def _on_gpu(model: torch.nn.Module | None) -> bool:
    if model is None:
        return False
    return any(p.device.type == "cuda" for p in model.parameters())


def _options(full: bool, model: torch.nn.Module | None) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=full, cpu_offload=full and _on_gpu(model))


def owner_module(optimizer: torch.optim.Optimizer, modules: Iterable[torch.nn.Module]) -> torch.nn.Module | None:
    """The registered module that holds every parameter of ``optimizer`` (None if none does)."""
    wanted = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for m in modules:
        if wanted <= {id(p) for p in m.parameters()}:
            return m
    return None


def gather_tree(tree: Any) -> Any:
    """Every DTensor leaf of ``tree`` gathered to a full tensor (collective: every rank, same order)."""
    return map_tree(tree, lambda _p, x: x.full_tensor() if is_dtensor(x) else x)


# -- saving ---------------------------------------------------------------------------------------
def module_state(model: torch.nn.Module, full: bool) -> dict[str, Any]:
    """FQN-keyed model state: gathered (``full``) or local DTensors sharing the live storage."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options(full or is_fsdp1(model), model))


def optimizer_state(optimizer: torch.optim.Optimizer, model: torch.nn.Module | None, full: bool) -> dict[str, Any]:
    """FQN-keyed optimizer state when its module is registered, else the optimizer's own (index keys)."""
    if model is None:
        sd = optimizer.state_dict()
        return gather_tree(sd) if full else sd
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=_options(full or is_fsdp1(model), model))


# -- loading --------------------------------------------------------------------------------------
def live_module_state(model: torch.nn.Module) -> dict[str, Any]:
    """FQN -> live tensor/DTensor sharing the module's storage (no communication)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options(False, model))


def load_module(model: torch.nn.Module, stored: dict[str, Any], where: str) -> None:
    """Load a stored (full or sharded) FQN-keyed model state into ``model`` in place, on every rank.

    A :class:`~checkpointd.restore.per_entry.KeySubset` (a non-strict restore) loads its keys only; the
    model's other keys stay as they are (FSDP1: ``StateDictOptions(strict=False)``).
    """
    partial = isinstance(stored, KeySubset)
    if is_fsdp1(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, materialize(stored), options=StateDictOptions(full_state_dict=True, strict=not partial))
        return
    live = live_module_state(model)
    missing = [] if partial else sorted(set(live) - set(stored))
    extra = sorted(set(stored) - set(live))
    if missing or extra:
        raise StateMismatchError(f"{where} does not match the checkpoint: missing keys {missing[:5]}, unexpected keys {extra[:5]}")
    # every key checked first (a tensor subclass that cannot be resharded is refused before any key is copied)
    copies = [plan_copy_into(t, stored[k], f"{where} key {k!r}")
              for k, t in live.items() if isinstance(t, torch.Tensor) and k in stored]
    for copy in copies:
        copy()


def check_optimizer(optimizer: torch.optim.Optimizer, model: torch.nn.Module | None, stored: Any, where: str) -> None:
    """Refuse, before anything is loaded, stored optimizer state whose parameter groups do not fit ``optimizer``
    (what :func:`load_optimizer` would refuse midway). FSDP1 is left to PyTorch's loader."""
    if model is not None and is_fsdp1(model):
        return
    if not isinstance(stored, dict) or not isinstance(stored.get("param_groups", []), list):
        raise StateMismatchError(f"{where}: the checkpoint holds a {type(stored).__name__}, not an optimizer state dict")
    _param_map(optimizer, model, stored.get("param_groups", []), where)


def load_optimizer(optimizer: torch.optim.Optimizer, model: torch.nn.Module | None, stored: dict[str, Any], where: str) -> None:
    """Load stored optimizer state (FQN- or index-keyed, full or sharded) into ``optimizer`` in place."""
    if model is not None and is_fsdp1(model):
        _load_optimizer_fsdp1(optimizer, model, stored, where)
        return
    saved_groups = stored.get("param_groups", [])
    param_of = _param_map(optimizer, model, saved_groups, where)
    saved_state = stored.get("state", {})
    if saved_state and not optimizer.state:
        from torch.distributed.checkpoint.state_dict import _init_optim_state

        _init_optim_state(optimizer)
    for key, st in saved_state.items():
        if key not in param_of:
            raise StateMismatchError(f"{where}: saved state for {key!r}, which no param group lists")
        p = param_of[key]
        live = optimizer.state[p]
        for name, v in st.items():
            _load_state_value(live, name, v, p, f"{where} state[{key!r}][{name!r}]")
    for sg, lg in zip(saved_groups, optimizer.param_groups):
        for k, v in sg.items():
            if k != "params":
                lg[k] = v


def _param_map(optimizer: torch.optim.Optimizer, model: torch.nn.Module | None, saved_groups: list[Any], where: str) -> dict[Any, torch.nn.Parameter]:
    """Saved parameter key (FQN or index) -> live parameter, group by group."""
    if len(saved_groups) != len(optimizer.param_groups):
        raise StateMismatchError(f"{where}: {len(optimizer.param_groups)} live param groups, {len(saved_groups)} saved")
    fqn_of = {id(p): clean_fqn(n) for n, p in unwrap_module(model).named_parameters()} if model is not None else {}
    param_of: dict[Any, torch.nn.Parameter] = {}
    for i, (sg, lg) in enumerate(zip(saved_groups, optimizer.param_groups)):
        if len(sg["params"]) != len(lg["params"]):
            raise StateMismatchError(f"{where}: param group {i} has {len(lg['params'])} live parameters, {len(sg['params'])} saved")
        if sg["params"] and all(isinstance(k, str) for k in sg["params"]):
            by_fqn = {fqn_of.get(id(p)): p for p in lg["params"]}
            for k in sg["params"]:
                if k not in by_fqn:
                    raise StateMismatchError(f"{where}: saved parameter {k!r} is not in live param group {i} (live: {sorted(str(x) for x in by_fqn)[:5]})")
                param_of[k] = by_fqn[k]
        else:
            param_of.update(zip(sg["params"], lg["params"]))
    return param_of


def _load_state_value(live: dict[str, Any], name: str, v: Any, p: torch.Tensor, where: str) -> None:
    shape = stored_shape(v)
    lv = live.get(name)
    if shape is None:
        live[name] = v
        return
    if isinstance(lv, torch.Tensor) and tuple(lv.shape) == shape:
        plan_copy_into(lv, v, where)()
        return
    dtype = v.dtype if isinstance(v, (torch.Tensor, ShardedLeaf)) else None
    if shape == tuple(p.shape) and len(shape) > 0:
        t = torch.zeros_like(p, dtype=dtype)  # DTensor params get a DTensor with their placements
        copy_into(t, v, where)
        live[name] = t
    else:
        live[name] = materialize(v).clone() if isinstance(v, torch.Tensor) else materialize(v)


# -- planning reads (before anything is read beyond rank 0's skeleton) ------------------------------
Want = Callable[[ShardedLeaf, Any], None]
"""``want(leaf, live)``: the load will copy ``leaf`` into ``live`` (see :meth:`ShardedLeaf.target_region`)."""


def plan_module(model: torch.nn.Module, stored: dict[str, Any], want: Want) -> None:
    """Name, for each stored leaf :func:`load_module` copies, the live tensor it goes into (no side effects).

    Leaves not named (FSDP1: everything is materialized) are read whole by the caller.
    """
    if is_fsdp1(model):
        return
    for k, t in live_module_state(model).items():
        v = stored.get(k)
        if isinstance(t, torch.Tensor) and isinstance(v, ShardedLeaf):
            want(v, t)


def plan_optimizer(optimizer: torch.optim.Optimizer, model: torch.nn.Module | None, stored: dict[str, Any], want: Want) -> None:
    """Like :func:`plan_module` for :func:`load_optimizer`: mirrors :func:`_load_state_value`'s choice of target.

    An optimizer without state yet gets it from ``_init_optim_state`` (zeros like each parameter, same
    placements), so the parameter stands in for the state tensor it will have.
    """
    if model is not None and is_fsdp1(model):
        return
    param_of = _param_map(optimizer, model, stored.get("param_groups", []), "plan")
    for key, st in stored.get("state", {}).items():
        p = param_of.get(key)
        if p is None or not isinstance(st, dict):
            continue
        live = optimizer.state.get(p) or {}
        for name, v in st.items():
            if not isinstance(v, ShardedLeaf):
                continue
            lv = live.get(name)
            if isinstance(lv, torch.Tensor) and tuple(lv.shape) == v.shape:
                want(v, lv)
            elif v.shape == tuple(p.shape) and len(v.shape) > 0:
                want(v, p)


# -- FSDP1 ----------------------------------------------------------------------------------------
def fsdp1_param_layouts(model: torch.nn.Module) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """FQN -> (shape, strides) of every non-contiguous original parameter inside an FSDP1 flat parameter."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    out: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    for name, mod in model.named_modules():
        handle = getattr(mod, "_handle", None) if isinstance(mod, FSDP) else None
        if handle is None or getattr(handle, "_use_orig_params", False):
            continue
        fp = handle.flat_param
        prefix = clean_fqn(name)
        for fqn, shape, stride, contig in zip(fp._fqns, fp._shapes, fp._strides, fp._contiguities):
            if not contig:
                full = f"{prefix}.{clean_fqn(fqn)}" if prefix else clean_fqn(fqn)
                out[full] = (tuple(shape), tuple(stride))
    return out


def fix_fsdp1_optimizer_layout(model: torch.nn.Module, osd: dict[str, Any]) -> dict[str, Any]:
    """Undo FSDP1's channels_last optimizer-state scramble (``use_orig_params=False``) before loading.

    FSDP1 stores a parameter in its flat parameter in *storage* order, but ``optim_state_dict_to_load``
    flattens the state tensors in *logical* order. Handing it, for a parameter with strides ``s``, the
    tensor ``v.permute(order).reshape(shape)`` (order = dims by decreasing stride) makes its logical
    flatten equal ``v``'s storage-order flatten, which is what the flat parameter expects.
    """
    layouts = fsdp1_param_layouts(model)
    if not layouts:
        return osd
    state = dict(osd.get("state", {}))
    for fqn, (shape, stride) in layouts.items():
        st = state.get(fqn)
        if not st:
            continue
        order = sorted(range(len(shape)), key=lambda d: (-stride[d], d))
        fixed = dict(st)
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and tuple(v.shape) == shape:
                fixed[k] = v.permute(order).contiguous().reshape(shape)
        state[fqn] = fixed
    return {**osd, "state": state}


def _load_optimizer_fsdp1(optimizer: torch.optim.Optimizer, model: torch.nn.Module, stored: dict[str, Any], where: str) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    osd = materialize(stored)
    groups = osd.get("param_groups", [])
    if any(not isinstance(k, str) for g in groups for k in g["params"]):
        raise StateMismatchError(
            f"{where}: the checkpoint's optimizer state is keyed by index (a single-process save); loading it into an "
            "FSDP1 model needs parameter names. Save it from an unwrapped model registered with its optimizer, or use FSDP2"
        )
    set_optimizer_state_dict(model, optimizer, fix_fsdp1_optimizer_layout(model, osd),
                             options=StateDictOptions(full_state_dict=True))


# -- errors of the state the ranks build -------------------------------------------------------------
def entry_tree(e: Entry) -> Any:
    """An entry's own state (no communication): what its ``state_dict()`` returns, or the tensor or data."""
    return as_state_error(e, "taking its state dict", lambda: entry_state(e))


def state_failure(exc: Exception, step: int) -> CheckpointError:
    """``exc`` as the CheckpointError this rank raises for the save of ``step`` (a StateError unless it is one already)."""
    if isinstance(exc, CheckpointError):
        return exc
    failure = StateError(f"this rank could not build its files for step {step}: {type(exc).__name__}: {exc}")
    failure.__cause__ = exc
    return failure


def as_state_error(e: Entry, doing: str, fn: Callable[[], Any]) -> Any:
    """``fn()``, with an exception that is not a CheckpointError raised as a StateError naming the entry."""
    try:
        return fn()
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - user code (state_dict, hooks): say which entry
        raise StateError(f"state[{e.name!r}] ({type(e.obj).__name__}): {doing} raised {type(exc).__name__}: {exc}; "
                         "fix it (or leave the entry out of state) and save again") from exc
