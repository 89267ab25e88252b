"""Registered state: what each entry of ``state`` is, which file it goes to, and its state dict.

This is the first stage of a save. It turns the user's ``{name: object}`` mapping into a list of
:class:`FileContent` trees (one per file of SPEC §3) made of containers, tensors and plain values, and
validates them, so that bad state raises from ``maybe_save`` itself before anything is written.
The trees still reference live tensors; the snapshot stage copies them.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, cast

import torch

from checkpointd.format import layout, subclasses
from checkpointd.errors import ConfigError, StateError

# Keys of PhysicsNeMo's training-state file, and ours.
OPTIMIZER_KEY = "optimizer_state_dict"
SCHEDULER_KEY = "scheduler_state_dict"
SCALER_KEY = "scaler_state_dict"
EPOCH_KEY = "epoch"
METADATA_KEY = "metadata"
RNG_KEY = "checkpointd_rng"
RESERVED_KEYS = frozenset({OPTIMIZER_KEY, SCHEDULER_KEY, SCALER_KEY, "static_capture_state_dict", EPOCH_KEY, METADATA_KEY, RNG_KEY})

_ROLE_KEYS = {"optimizer": OPTIMIZER_KEY, "scheduler": SCHEDULER_KEY, "scaler": SCALER_KEY}
_ATOMS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)


@dataclass
class Entry:
    """One registered state entry and where it is stored."""

    name: str
    obj: Any
    kind: str
    """module | optimizer | scheduler | scaler | stateful | tensor | data"""
    key: str | None = None
    """Key in the training-state file (None for modules, which get a file of their own)."""
    file_stem: str | None = None
    """``{ClassName}{id}`` for modules."""
    class_name: str | None = None
    physicsnemo: bool = False


@dataclass
class FileContent:
    """The tree of one file to write, before the snapshot copies its tensors."""

    rel_path: str
    format: str  # "pt" or "mdlus"
    tree: Any
    entry_names: list[str] = field(default_factory=list)
    json_members: dict[str, bytes] | None = None
    rank: int = 0
    """The rank that writes this file (distributed runs; recorded as FileEntry.rank)."""


class DeferredScalar:
    """A 0-dim device tensor that the file must hold as a Python number (GradScaler's scale).

    Reading it with ``.item()`` on the training thread would synchronise with the GPU; the snapshot
    copies the tensor like any other, and the background writer turns it into a number.
    """

    def __init__(self, tensor: torch.Tensor, as_type: type) -> None:
        self.tensor = tensor
        self.as_type = as_type


def unwrap_module(module: torch.nn.Module) -> torch.nn.Module:
    """Peel DDP/DataParallel (``.module``) and ``torch.compile`` (``._orig_mod``) wrappers."""
    seen = 0
    while seen < 8:
        seen += 1
        if hasattr(module, "_orig_mod") and isinstance(module._orig_mod, torch.nn.Module):
            module = module._orig_mod
        elif type(module).__name__ in ("DistributedDataParallel", "DataParallel") and isinstance(
            getattr(module, "module", None), torch.nn.Module
        ):
            module = cast(torch.nn.Module, module.module)
        else:
            break
    return module


def user_class_name(module: torch.nn.Module) -> str:
    """The class name a user recognises: FSDP1 wrappers peeled, FSDP2's synthetic ``FSDP<Name>`` undone."""
    module = unwrap_module(module)
    if type(module).__name__ == "FullyShardedDataParallel" and isinstance(getattr(module, "module", None), torch.nn.Module):
        module = unwrap_module(cast(torch.nn.Module, module.module))
    cls = type(module)
    name = cls.__name__
    if name.startswith("FSDP") and any(base.__name__ == name[4:] for base in cls.__mro__[1:]):
        return name[4:]  # FSDP2's fully_shard swaps the class for FSDP<Name>(FSDPModule, <Name>)
    return name


def classify(name: str, obj: Any) -> str:
    if isinstance(obj, torch.nn.Module):
        return "module"
    if isinstance(obj, torch.optim.Optimizer):
        return "optimizer"
    if isinstance(obj, torch.optim.lr_scheduler.LRScheduler) or type(obj).__name__ == "ReduceLROnPlateau":
        return "scheduler"
    if _is_grad_scaler(obj):
        return "scaler"
    if callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
        return "stateful"
    if isinstance(obj, torch.Tensor):
        return "tensor"
    if isinstance(obj, (dict, list)):
        return "data"
    raise StateError(
        f"state[{name!r}] is a {type(obj).__name__}, which checkpointd cannot restore in place: register an "
        "nn.Module, optimizer, LR scheduler, GradScaler, an object with state_dict()/load_state_dict(), a tensor, "
        "or a dict/list of plain data (wrap immutable values such as ints in a dict)"
    )


def _is_grad_scaler(obj: Any) -> bool:
    return type(obj).__name__ == "GradScaler" and hasattr(obj, "get_scale") and hasattr(obj, "load_state_dict")


def build_entries(state: Mapping[str, Any], is_physicsnemo: Callable[[Any], bool] | None = None) -> list[Entry]:
    """Classify every entry of ``state`` and assign file stems and training-state keys.

    Raises:
        StateError: non-string key or unsupported object.
        ConfigError: an entry name that collides with a reserved training-state key.
    """
    if not isinstance(state, Mapping):
        raise StateError(f"state must be a mapping of names to objects, got {type(state).__name__}")
    entries: list[Entry] = []
    taken_roles: set[str] = set()
    for name, obj in state.items():
        if not isinstance(name, str) or not name:
            raise StateError(f"state keys must be non-empty strings, got {name!r} ({type(name).__name__}); rename the entry")
        kind = classify(name, obj)
        entry = Entry(name=name, obj=obj, kind=kind)
        if kind == "module":
            entry.class_name = user_class_name(obj)
            entry.physicsnemo = bool(is_physicsnemo and is_physicsnemo(unwrap_module(obj)))
        else:
            role_key = _ROLE_KEYS.get(kind)
            if role_key is not None and role_key not in taken_roles:
                entry.key = role_key
                taken_roles.add(role_key)
            else:
                if name in RESERVED_KEYS:
                    raise ConfigError(
                        f"state entry {name!r} collides with a reserved key of the training-state file "
                        f"({sorted(RESERVED_KEYS)}); rename it"
                    )
                entry.key = name
        entries.append(entry)
    _assign_module_stems(entries)
    return entries


def _assign_module_stems(entries: list[Entry]) -> None:
    """PhysicsNeMo naming: ``{ClassName}`` alone, or ``{ClassName}{i}`` when several modules share a class."""
    by_class: dict[str, list[Entry]] = {}
    for e in entries:
        if e.kind == "module":
            by_class.setdefault(e.class_name or "", []).append(e)
    for cls_name, group in by_class.items():
        for i, e in enumerate(group):
            e.file_stem = f"{cls_name}{i}" if len(group) > 1 else cls_name


def entry_state(entry: Entry) -> Any:
    """What gets stored for one entry (state dict, tensor or data), still sharing live tensors."""
    obj = entry.obj
    if entry.kind == "module":
        return unwrap_module(obj).state_dict()
    if entry.kind == "scaler":
        return scaler_state_dict(obj)
    if entry.kind in ("optimizer", "scheduler", "stateful"):
        return obj.state_dict()
    return obj


def scaler_state_dict(scaler: Any) -> dict[str, Any]:
    """``GradScaler.state_dict()`` without its ``.item()`` syncs: device tensors become DeferredScalars."""
    scale = getattr(scaler, "_scale", None)
    tracker = getattr(scaler, "_growth_tracker", None)
    if not getattr(scaler, "_enabled", True) or not isinstance(scale, torch.Tensor) or scale.device.type == "cpu":
        return scaler.state_dict()
    return {
        "scale": DeferredScalar(scale, float),
        "growth_factor": scaler._growth_factor,
        "backoff_factor": scaler._backoff_factor,
        "growth_interval": scaler._growth_interval,
        "_growth_tracker": DeferredScalar(tracker, int) if isinstance(tracker, torch.Tensor) else 0,
    }


def build_files(entries: list[Entry], step: int, metrics: dict[str, Any], rng: dict[str, Any], codec_suffix: str,
                mdlus_members: Callable[[Any], dict[str, bytes]] | None = None,
                state_of: Callable[[Entry], Any] = entry_state) -> list[FileContent]:
    """The files of one full-mode save (SPEC §3), trees validated and ready to snapshot."""
    files: list[FileContent] = []
    training: dict[str, Any] = {}
    training_names: list[str] = []
    for e in entries:
        tree = state_of(e)
        validate_tree(tree, f"state[{e.name!r}]", module_keys=e.kind == "module")
        if e.kind == "module":
            ext = "mdlus" if e.physicsnemo else "pt"
            rel = layout.model_file_name(e.file_stem or e.class_name or e.name, step, ext, codec_suffix)
            members = mdlus_members(unwrap_module(e.obj)) if (e.physicsnemo and mdlus_members) else None
            files.append(FileContent(rel_path=rel, format=ext, tree=tree, entry_names=[e.name], json_members=members))
        else:
            training[e.key or e.name] = tree
            training_names.append(e.name)
    training[EPOCH_KEY] = step
    training[METADATA_KEY] = metrics
    training[RNG_KEY] = rng
    files.append(FileContent(rel_path=layout.training_state_file_name(step, codec_suffix), format="pt",
                             tree=training, entry_names=training_names))
    return files


def clean_metrics(metrics: Mapping[str, Any] | None) -> dict[str, Any]:
    """Metrics as plain JSON-able numbers/strings (tensors become Python numbers)."""
    out: dict[str, Any] = {}
    for k, v in (metrics or {}).items():
        if not isinstance(k, str):
            raise StateError(f"metrics keys must be strings, got {k!r}")
        if isinstance(v, torch.Tensor):
            if v.numel() != 1:
                raise StateError(f"metrics[{k!r}] is a tensor with {v.numel()} elements; pass a number")
            v = v.item()
        elif hasattr(v, "item") and callable(v.item):  # numpy scalars
            v = v.item()
        if not isinstance(v, (int, float, str, bool, type(None))):
            raise StateError(f"metrics[{k!r}] is a {type(v).__name__}; metrics must be numbers, strings, bools or None")
        out[k] = v
    return out


def validate_tree(tree: Any, where: str, module_keys: bool = False) -> None:
    """Raise StateError for anything a weights-only ``torch.load`` could not read back, and for tensors
    the snapshot cannot copy as plain bytes: meta, nested, quantized, sparse or other non-strided ones,
    and tensor subclasses that :mod:`checkpointd.format.subclasses` cannot store through their inner tensors."""
    _validate(tree, (where,), module_keys, depth=0)


def _where(path: tuple[Any, ...]) -> str:
    """``state['model']['a.weight']`` from the path ``(((root,), 'model'), 'a.weight')``.

    Why nested pairs instead of a string per node: ``maybe_save`` validates every node on the
    training thread, and formatting a path for each of a few hundred nodes cost more than the checks;
    the text is only needed for an error.
    """
    keys = []
    while len(path) == 2:
        path, key = path
        keys.append(f"[{key!r}]")
    return path[0] + "".join(reversed(keys))


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_PLAIN_ATOMS = frozenset((type(None), bool, int, float, str))
_STRIDED = torch.strided
_SPARSE_LAYOUTS = frozenset((torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc))


def _plain_leaf(v: Any) -> bool:
    """A value that needs no further check: a dense plain tensor or a common atom (the fast path of
    :func:`_validate`, which sees every tensor and number of the state at every save)."""
    t = type(v)
    if t in _PLAIN_TENSORS:
        return v.layout is _STRIDED and not (v.is_meta or v.is_nested or v.is_quantized)
    return t in _PLAIN_ATOMS


def _tensor_problem(t: torch.Tensor) -> str | None:
    """Why the tensor ``t`` cannot be stored, and what to do instead; None when it can."""
    if t.is_meta:
        return "is a meta tensor (no data); materialize it (e.g. to_empty + init) before saving"
    if t.is_nested:
        return (f"is a nested tensor (layout {t.layout}), which checkpointd cannot store; register plain dense "
                "tensors instead (e.g. its components from unbind(), or to_padded_tensor() and the lengths)")
    if t.is_quantized:
        scheme = t.qscheme()
        params = ("q_per_channel_scales()/q_per_channel_zero_points()/q_per_channel_axis()"
                  if scheme in (torch.per_channel_affine, torch.per_channel_symmetric,
                                torch.per_channel_affine_float_qparams)
                  else "q_scale()/q_zero_point()")
        return (f"is a quantized tensor ({t.dtype}, {scheme}), which checkpointd cannot store; dequantize it "
                f"(dequantize()) or register its int_repr() and {params} as plain tensors and numbers")
    if t.layout in _SPARSE_LAYOUTS:
        return (f"is a sparse tensor (layout {t.layout}), which checkpointd cannot store; convert it to a dense "
                "tensor (to_dense()) before saving, or register its index and value tensors")
    if t.layout is not _STRIDED:
        return f"has layout {t.layout}; convert it to a dense tensor (to_dense()) before saving"
    if _is_dtensor(t):
        local = getattr(t, "_local_tensor", None)  # the attribute: to_local() is an autograd op, ~6 us a tensor
        local = t.to_local() if local is None else local
        if type(local) not in _PLAIN_TENSORS:  # FSDP2 over torchao's NF4 or float8 all-gather weights
            problem = subclasses.save_problem(local, _tensor_problem)
            if problem is None and any(type(getattr(local, n)) not in _PLAIN_TENSORS for n in local.__tensor_flatten__()[0]):
                problem = (f"is a tensor subclass {subclasses.qualname(type(local))} whose inner tensors are tensor "
                           "subclasses, which sharded checkpoints cannot split; save with mode='full'")
            return None if problem is None else f"is a DTensor whose local tensor {problem}"
        return None
    if type(t) not in _PLAIN_TENSORS:
        return subclasses.save_problem(t, _tensor_problem)  # stored through its inner tensors, or refused
    return None


def _validate(obj: Any, path: tuple[Any, ...], str_keys: bool, depth: int) -> None:
    if depth > 100:
        raise StateError(f"{_where(path)} nests deeper than 100 levels (a reference cycle?)")
    if isinstance(obj, torch.Tensor):
        problem = _tensor_problem(obj)
        if problem is not None:
            raise StateError(f"{_where(path)} {problem}")
        return
    if isinstance(obj, DeferredScalar):
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            if type(k) is not str:  # the common case skips both checks
                if str_keys and not isinstance(k, str):
                    raise StateError(f"{_where(path)} has a non-string key {k!r} ({type(k).__name__}); state dict keys must be strings")
                if not isinstance(k, (str, int, float, bool, type(None), tuple)):
                    raise StateError(f"{_where(path)} has a key of type {type(k).__name__} ({k!r}); use str or int keys")
            if not _plain_leaf(v):
                _validate(v, (path, k), False, depth + 1)
        return
    if isinstance(obj, (list, tuple, set, frozenset)):
        if isinstance(obj, tuple) and type(obj) is not tuple and not isinstance(obj, torch.Size):
            raise StateError(f"{_where(path)} is a {type(obj).__name__} (a namedtuple?); use a plain tuple, list or dict")
        for i, v in enumerate(obj):
            if not _plain_leaf(v):
                _validate(v, (path, i), False, depth + 1)
        return
    if isinstance(obj, _ATOMS):
        return
    raise StateError(
        f"{_where(path)} is a {type(obj).__module__}.{type(obj).__qualname__}, which cannot be stored safely "
        "(checkpoints load without unpickling code): convert it to tensors, numbers, strings, lists or dicts"
    )


def _is_dtensor(t: Any) -> bool:
    return type(t).__name__ == "DTensor"


def copy_tree(obj: Any, on_tensor: Callable[[torch.Tensor], Any]) -> Any:
    """Rebuild the containers of ``obj`` (same types), mapping tensors and DeferredScalars through ``on_tensor``.

    Non-tensor leaves are immutable atoms and are shared, so later mutation of the user's containers
    never leaks into a snapshot. Tensor values of dicts are mapped without a recursive call: a save
    walks every tensor of the state on the training thread.
    """
    if isinstance(obj, torch.Tensor):
        return on_tensor(obj)
    if isinstance(obj, DeferredScalar):
        return DeferredScalar(on_tensor(obj.tensor), obj.as_type)
    if isinstance(obj, dict):
        items = [(k, on_tensor(v) if isinstance(v, torch.Tensor) else copy_tree(v, on_tensor)) for k, v in obj.items()]
        return OrderedDict(items) if isinstance(obj, OrderedDict) else dict(items)
    if isinstance(obj, list):
        return [copy_tree(v, on_tensor) for v in obj]
    if isinstance(obj, torch.Size):
        return obj
    if isinstance(obj, tuple):
        return tuple(copy_tree(v, on_tensor) for v in obj)
    if isinstance(obj, (set, frozenset)):
        return type(obj)(copy_tree(v, on_tensor) for v in obj)
    return obj
