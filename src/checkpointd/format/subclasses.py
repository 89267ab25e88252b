"""Tensor subclasses (torchao's ``Int8Tensor``, ``Float8Tensor``, ``NF4Tensor``, ...) stored bit-exactly.

A traceable wrapper subclass (one implementing ``__tensor_flatten__``/``__tensor_unflatten__``) is a
plain Python object around plain *inner* tensors (quantized data, scales, zero points). checkpointd
never dequantizes it:

- **save**: the snapshot stages the inner tensors like any plain tensor (pinned staging, device
  staging and the host budget only ever see plain tensors) and keeps a :class:`SubclassRecord` in the
  file's tree. The record pickles to exactly what ``torch.save`` writes for the live object
  (``_rebuild_from_type_v2(_rebuild_wrapper_subclass, cls, ..., state)``, ``state`` = the object's
  ``__dict__`` with the staged inner tensors), so ``torch.load(weights_only=True)`` in a process that
  has imported the class's library (torchao registers its classes as safe globals) reads the file
  back as the subclass. Every subclass key is listed in the manifest (:func:`describe_records`).
- **load**: only classes this process has imported *and* that are accepted (:data:`BUILTIN_CLASSES`
  or :func:`allow_tensor_subclasses`) are rebuilt. :func:`check_described` refuses a step from its
  manifest before any pickle runs; nothing is ever imported by name from a file, and torch's
  weights-only unpickler still runs underneath.

Limits: non-tensor attributes must be weights-only data (atoms, containers, and enums, dataclasses or
named tuples of classes registered with ``torch.serialization.add_safe_globals``); a class whose pickle
cannot be expressed that way (TransformerEngine's ``Float8Tensor``) is refused at save.
"""

from __future__ import annotations

import dataclasses
import enum
import sys
from typing import Any, Callable, Iterable, Mapping

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from checkpointd.errors import ConfigError, CorruptCheckpointError, UnacceptedSubclassError

BUILTIN_CLASSES = frozenset({
    "torchao.quantization.Int8Tensor",
    "torchao.quantization.Float8Tensor",
    "torchao.quantization.quantize_.workflows.nf4.nf4_tensor.NF4Tensor",
    "torchao.float8.float8_training_tensor.Float8TrainingTensor",
    "torchao.float8.fsdp_utils.WeightWithDynamicFloat8CastTensor",
    # torchao.optim's low-bit optimizer states (AdamW8bit, AdamW4bit, AdamWFp8, ...)
    "torchao.optim.subclass_8bit.OptimState8bit",
    "torchao.optim.subclass_4bit.OptimState4bit",
    "torchao.optim.subclass_fp8.OptimStateFp8",
})
"""Classes accepted once the caller's process has imported them (looked up in ``sys.modules`` only)."""

ALLOWED: dict[str, type] = {}
"""Classes the caller accepted with :func:`allow_tensor_subclasses`, by qualified name."""

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_ATOMS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size, torch.layout)
_SAFE_TYPES: set[type] = set()  # classes found among torch's safe globals (only positive answers are kept)


def qualname(cls: type) -> str:
    """``module.QualName`` of a class: what a pickle of it names."""
    return f"{cls.__module__}.{cls.__qualname__}"


def is_stored_subclass(t: Any) -> bool:
    """A tensor subclass stored through its inner tensors: traceable, not a DTensor, not nested."""
    return (isinstance(t, torch.Tensor) and type(t) not in _PLAIN and type(t).__name__ != "DTensor"
            and is_traceable_wrapper_subclass(t) and not t.is_nested)


def allow_tensor_subclasses(*classes: type, ctx_types: Iterable[type] = ()) -> None:
    """Accept these traceable tensor subclasses in checkpoints (save, restore and ``load``).

    Call it only for classes whose code you trust: a restore rebuilds them (their
    ``__tensor_unflatten__`` and attribute setting run). They, and ``ctx_types`` (the enums,
    dataclasses or named tuples their attributes hold), are also registered with
    ``torch.serialization.add_safe_globals``, so ``torch.load(weights_only=True)`` reads checkpointd's
    files of them in this process. torchao's quantized tensors need no call: importing torchao is enough.

    Raises:
        ConfigError: a class that is not a tensor subclass with ``__tensor_flatten__``/``__tensor_unflatten__``.
    """
    extra = list(ctx_types)
    for cls in classes:
        if not (isinstance(cls, type) and issubclass(cls, torch.Tensor) and cls not in _PLAIN
                and callable(getattr(cls, "__tensor_flatten__", None))
                and callable(getattr(cls, "__tensor_unflatten__", None))):
            raise ConfigError(f"allow_tensor_subclasses({cls!r}): not a tensor subclass implementing "
                              "__tensor_flatten__ and __tensor_unflatten__")
    torch.serialization.add_safe_globals([*classes, *extra])
    for cls in classes:
        ALLOWED[qualname(cls)] = cls


def accepted_class(name: str) -> type | None:
    """The class ``name`` names if it is accepted and already imported in this process; never imports."""
    cls = ALLOWED.get(name)
    if cls is not None:
        return cls
    if name not in BUILTIN_CLASSES:
        return None
    module, _, attr = name.rpartition(".")
    found = getattr(sys.modules.get(module), attr, None)
    return found if isinstance(found, type) and qualname(found) == name else None


# -- save -------------------------------------------------------------------------------------------

def save_problem(t: torch.Tensor, inner_problem: Callable[[torch.Tensor], str | None]) -> str | None:
    """Why the tensor subclass ``t`` cannot be stored, and what to do; None when it can.

    ``inner_problem`` checks each inner plain tensor (meta, sparse, ...) like any tensor of the state.
    """
    cls = type(t)
    name = qualname(cls)
    if not is_traceable_wrapper_subclass(t):
        return (f"is a tensor subclass {name} that does not implement __tensor_flatten__/__tensor_unflatten__, "
                "which checkpointd cannot store; register plain tensors")
    if accepted_class(name) is not cls:
        return (f"is a tensor subclass {name}, which checkpointd does not accept; if you trust its code, call "
                f"checkpointd.allow_tensor_subclasses({cls.__name__}) before saving and before loading, or "
                "register plain tensors")
    for key, value in torch._utils._get_obj_state(t).items():
        if isinstance(value, torch.Tensor):
            problem = save_problem(value, inner_problem) if type(value) not in _PLAIN else inner_problem(value)
            if problem is not None:
                return f"({cls.__name__}) has an inner tensor {key!r} that {problem}"
        else:
            bad = _unsafe_value(value, 0)
            if bad is not None:
                return (f"is a tensor subclass {name} whose attribute {key!r} holds a {bad}, which a weights-only "
                        "loader cannot read; register that type with checkpointd.allow_tensor_subclasses("
                        f"{cls.__name__}, ctx_types=[...]) if it is plain data, or store a dequantized copy")
    return None


def _unsafe_value(v: Any, depth: int) -> str | None:
    """The qualified type name of the first part of ``v`` a weights-only unpickler refuses; None if none."""
    if depth > 20:
        return "value nested deeper than 20 levels"
    if isinstance(v, _ATOMS):
        return None
    if type(v) in (list, tuple, set, frozenset):
        return next((b for b in (_unsafe_value(x, depth + 1) for x in v) if b), None)
    if type(v) is dict:
        return next((b for b in (_unsafe_value(x, depth + 1) for kv in v.items() for x in kv) if b), None)
    cls = type(v)
    if not _is_safe_global(cls):
        return qualname(cls)
    if isinstance(v, enum.Enum):
        return None
    if dataclasses.is_dataclass(v):
        return next((b for b in (_unsafe_value(getattr(v, f.name), depth + 1) for f in dataclasses.fields(v)) if b), None)
    if isinstance(v, tuple) and hasattr(v, "_fields"):
        return next((b for b in (_unsafe_value(x, depth + 1) for x in v) if b), None)
    return qualname(cls)


def _is_safe_global(cls: type) -> bool:
    if cls in _SAFE_TYPES:
        return True
    safe = {g[0] if isinstance(g, tuple) else g for g in torch.serialization.get_safe_globals()}
    if cls in safe:
        _SAFE_TYPES.add(cls)
        return True
    return False


class SubclassRecord:
    """A live tensor subclass in a snapshot: its class, outer layout and attributes, inner tensors replaced.

    The training thread builds it with the inner tensors mapped to snapshot slots; the committer thread
    maps the slots to staged CPU tensors (:meth:`mapped`). Pickled, it is what ``torch.save`` writes
    for the subclass, rebuilt on the CPU (no subclass object is constructed at save time).
    """

    __slots__ = ("cls", "dtype", "size", "stride", "offset", "requires_grad", "state")

    def __init__(self, cls: type, dtype: torch.dtype, size: tuple[int, ...], stride: tuple[int, ...], offset: int,
                 requires_grad: bool, state: dict[str, Any]) -> None:
        self.cls, self.dtype, self.size, self.stride = cls, dtype, size, stride
        self.offset, self.requires_grad, self.state = offset, requires_grad, state

    @classmethod
    def of(cls, t: torch.Tensor, on_tensor: Callable[[torch.Tensor], Any]) -> SubclassRecord:
        """The record of the live subclass ``t``; ``on_tensor`` maps each inner tensor (training thread)."""
        state = {k: on_tensor(v.detach()) if isinstance(v, torch.Tensor) else v
                 for k, v in torch._utils._get_obj_state(t).items()}
        return cls(type(t), t.dtype, tuple(t.size()), t.stride(), t.storage_offset(), t.requires_grad, state)

    def mapped(self, fn: Callable[[Any], Any]) -> SubclassRecord:
        """The same record with ``fn`` applied to its inner tensors (or their slots, or nested records);
        plain-data attributes are kept as they are (a named tuple stays one)."""
        return SubclassRecord(self.cls, self.dtype, self.size, self.stride, self.offset, self.requires_grad,
                              {k: v if _is_data(v) else fn(v) for k, v in self.state.items()})

    def inner(self) -> dict[str, Any]:
        """Attributes that are inner tensors (or their slots), by name."""
        return {k: v for k, v in self.state.items() if not _is_data(v)}

    def __reduce__(self) -> tuple[Any, ...]:
        args = (self.cls, self.dtype, self.size, self.stride, self.offset, torch.strided, torch.device("cpu"),
                self.requires_grad)
        return torch._tensor._rebuild_from_type_v2, (torch._utils._rebuild_wrapper_subclass, self.cls, args, self.state)


def _is_data(v: Any) -> bool:
    return isinstance(v, _ATOMS) or type(v) in (list, tuple, dict, set, frozenset) or isinstance(v, enum.Enum) \
        or dataclasses.is_dataclass(v) or (isinstance(v, tuple) and hasattr(v, "_fields"))


def describe_records(tree: Any, dtype_of: Callable[[Any], tuple[str, list[int]]]) -> dict[str, Any]:
    """``{key path: {"class", "form", "inner": {name: {"dtype", "shape"}}}}`` of every record in ``tree``.

    The manifest keeps this per file (``extra["subclasses"]``) so that a restore refuses a class that is
    not accepted before any pickle runs. ``dtype_of(inner)`` gives an inner's ``(dtype name, shape)``.
    """
    out: dict[str, Any] = {}

    def visit(obj: Any, path: tuple[str, ...]) -> None:
        if isinstance(obj, SubclassRecord):
            inner = {}
            for name, v in obj.inner().items():
                if isinstance(v, SubclassRecord):
                    visit(v, path + (name,))
                    continue
                dtype, shape = dtype_of(v)
                inner[name] = {"dtype": dtype, "shape": shape}
            out["/".join(path)] = {"class": qualname(obj.cls), "form": "torch", "inner": inner}
        elif isinstance(obj, dict):
            for k, v in obj.items():
                visit(v, path + (str(k),))
        elif isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
            for i, v in enumerate(obj):
                visit(v, path + (str(i),))

    visit(tree, ())
    return out


# -- load -------------------------------------------------------------------------------------------

def refusal(name: str, where: str) -> str:
    """Why the class ``name`` held at ``where`` is not rebuilt, and what the caller can do."""
    module = name.rpartition(".")[0]
    if name in BUILTIN_CLASSES or module in sys.modules:
        reason = ("which this process has not imported" if name in BUILTIN_CLASSES
                  else "which checkpointd does not accept")
        fix = (f"import {module.split('.')[0]} before loading" if name in BUILTIN_CLASSES
               else f"if you trust its code, call checkpointd.allow_tensor_subclasses({name.rpartition('.')[2]})")
    else:
        reason = "which this process has not imported and checkpointd does not accept"
        fix = (f"import {module or name} and, if you trust its code, call "
               f"checkpointd.allow_tensor_subclasses({name.rpartition('.')[2]})")
    return f"{where} holds a tensor subclass {name}, {reason}; nothing of it was run. To load it, {fix}"


def check_described(described: Any, where: str) -> None:
    """Refuse, from the manifest's ``extra["subclasses"]`` alone, a step holding a class not accepted.

    Raises:
        UnacceptedSubclassError: a key holds a class that is not imported or not accepted.
        CorruptCheckpointError: the description is malformed.
    """
    if described is None:
        return
    if not isinstance(described, Mapping):
        raise CorruptCheckpointError(f"{where}: the manifest's subclass list is malformed")
    for rel, keys in described.items():
        if not isinstance(keys, Mapping):
            raise CorruptCheckpointError(f"{where}: the manifest's subclass list for {rel!r} is malformed")
        for key, desc in keys.items():
            name = desc.get("class") if isinstance(desc, Mapping) else None
            if not isinstance(name, str):
                raise CorruptCheckpointError(f"{where}: the manifest's subclass entry {rel!r} {key!r} is malformed")
            if accepted_class(name) is None:
                raise UnacceptedSubclassError(refusal(name, f"{where} {rel} key {key!r}"))


def check_loaded(obj: Any, where: str) -> None:
    """Refuse loaded values holding a tensor subclass that is not accepted (a file without a manifest,
    or one whose manifest did not list it): torch's safe globals may hold classes checkpointd does not accept."""
    for path, t in _subclasses_in(obj, ()):
        if accepted_class(qualname(type(t))) is not type(t):
            raise UnacceptedSubclassError(refusal(qualname(type(t)), f"{where} key {'/'.join(path)!r}"))


def subclass_paths(obj: Any) -> list[str]:
    """``"a/b/c"`` paths of the tensor subclass values in a tree of loaded values."""
    return ["/".join(path) for path, _ in _subclasses_in(obj, ())]


def _subclasses_in(obj: Any, path: tuple[str, ...]) -> Iterable[tuple[tuple[str, ...], torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        if type(obj) not in _PLAIN and is_stored_subclass(obj):
            yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _subclasses_in(v, path + (str(k),))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _subclasses_in(v, path + (str(i),))


# -- sharded mode: a DTensor's local subclass ---------------------------------------------------------

def local_description(t: torch.Tensor) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(class part, block part)`` of the records of a DTensor whose local tensor is the subclass ``t``.

    The class part (``{"class", "form", "inner": {name: {"dtype"}}}``) is the same on every rank; the
    block part (``{"inner_shapes": {name: shape}, "ctx": description}``) is this rank's: a shard's
    flatten context can be its own (NF4 records the local shape). ``ctx`` is a JSON description for
    inspection and planning, not what a restore rebuilds from (the stored object carries its context).

    Raises:
        ValueError: an inner tensor that is itself a subclass (nested subclasses are not sharded).
    """
    names, ctx = t.__tensor_flatten__()
    inner: dict[str, Any] = {}
    shapes: dict[str, list[int]] = {}
    for n in names:
        v = getattr(t, n)
        if type(v) not in _PLAIN and is_stored_subclass(v):
            raise ValueError(f"its inner tensor {n!r} is itself a tensor subclass ({qualname(type(v))})")
        inner[n] = {"dtype": str(v.dtype).removeprefix("torch.")}
        shapes[n] = list(v.shape)
    return ({"class": qualname(type(t)), "form": "torch", "inner": inner},
            {"inner_shapes": shapes, "ctx": describe_ctx(ctx)})


def describe_ctx(ctx: Any, depth: int = 0) -> Any:
    """A JSON description of a flatten context: atoms as they are, dtypes, devices and enums by name,
    dataclasses and named tuples as ``{"type": qualified name, "fields": {...}}``, anything else by type."""
    if depth > 20:
        return "..."
    if ctx is None or isinstance(ctx, (bool, int, float, str)) and not isinstance(ctx, enum.Enum):
        return ctx
    if isinstance(ctx, (torch.dtype, torch.device, torch.layout)):
        return str(ctx)
    if isinstance(ctx, torch.Size):
        return list(ctx)
    if isinstance(ctx, enum.Enum):
        return f"{qualname(type(ctx))}.{ctx.name}"
    if isinstance(ctx, dict):
        return {str(k): describe_ctx(v, depth + 1) for k, v in ctx.items()}
    if isinstance(ctx, tuple) and hasattr(ctx, "_fields"):
        return {"type": qualname(type(ctx)), "fields": {f: describe_ctx(getattr(ctx, f), depth + 1) for f in ctx._fields}}
    if isinstance(ctx, (list, tuple, set, frozenset)):
        return [describe_ctx(v, depth + 1) for v in ctx]
    if dataclasses.is_dataclass(ctx) and not isinstance(ctx, type):
        return {"type": qualname(type(ctx)),
                "fields": {f.name: describe_ctx(getattr(ctx, f.name), depth + 1) for f in dataclasses.fields(ctx)}}
    return {"type": qualname(type(ctx))}


def check_sharded_described(sharded: Any, where: str) -> None:
    """Refuse, from a sharded manifest's tensor records (``extra["sharded"]``) alone, a step holding a
    DTensor whose local tensor is a class not accepted; run before any of its files is unpickled.

    Raises:
        UnacceptedSubclassError: a record names a class that is not imported or not accepted.
        CorruptCheckpointError: a record's subclass part is malformed.
    """
    tensors = sharded.get("tensors") if isinstance(sharded, Mapping) else None
    if not isinstance(tensors, Mapping):
        return
    for name, by_path in tensors.items():
        if not isinstance(by_path, Mapping):
            continue
        for path, rec in by_path.items():
            part = rec.get("subclass") if isinstance(rec, Mapping) else None
            if part is None:
                continue
            cls = part.get("class") if isinstance(part, Mapping) else None
            if not isinstance(cls, str) or not isinstance(part.get("inner"), Mapping):
                raise CorruptCheckpointError(f"{where}: the manifest's record of entry {name!r} tensor {path} is malformed")
            if accepted_class(cls) is None:
                raise UnacceptedSubclassError(refusal(cls, f"{where} entry {name!r} tensor {path}"))


__all__ = ["ALLOWED", "BUILTIN_CLASSES", "SubclassRecord", "accepted_class", "allow_tensor_subclasses",
           "check_described", "check_loaded", "check_sharded_described", "describe_ctx", "describe_records",
           "is_stored_subclass", "local_description", "qualname", "refusal", "save_problem"]
