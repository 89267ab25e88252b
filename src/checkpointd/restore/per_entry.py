"""The per-entry restore path: which entries a restore loads, whether the live objects can take the
stored values, and loading one entry.

:func:`select_entries` turns a restore's ``entries=``/``strict=`` into a :class:`Selection`.
:func:`fit_values` refuses a step before anything is touched when a chosen live module, optimizer,
tensor or data entry cannot take its stored value; with ``strict=False`` it keeps what fits and says
what it leaves (:class:`Fitted`). :func:`apply_entry` loads one value the way the object's own
``load_state_dict`` (or ``copy_``) does; the bulk apply (:mod:`checkpointd.restore.apply`) falls back
to it for every entry it cannot plan.

What ``strict=False`` relaxes, and what it does not:

- an entry the checkpoint lacks is left as it is; a checkpoint entry nobody registered is ignored;
- inside a module (``nn.Module``), like ``load_state_dict(strict=False)``: keys the checkpoint lacks, and
  keys whose stored shape differs from the live one (a new head), are left as they are, saved keys the
  module lacks are ignored, and every other key is restored (:class:`KeySubset`);
- nothing else: an optimizer's parameter groups, a tensor entry's shape, a plain-data entry's type and
  the class of an optimizer, scheduler, scaler or other stateful object must still match.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch

from checkpointd.errors import ConfigError, StateMismatchError
from checkpointd.format.sharding import is_dtensor, stored_shape
from checkpointd.format.subclasses import is_stored_subclass, qualname
from checkpointd.state import RESERVED_KEYS, Entry, unwrap_module


@dataclass(frozen=True)
class Selection:
    """Which registered entries a restore loads (``entries=``), and how strictly (``strict=``)."""

    entries: tuple[Entry, ...]
    """The entries to restore, in registration order."""
    registered: tuple[str, ...]
    """Every registered state name."""
    strict: bool = True
    read_all: bool = True
    """No ``entries=``: every data file of the step is read and verified, as always; with
    ``entries=`` only the files holding the chosen entries (and the RNG state, when restored) are."""

    @property
    def restores_rng(self) -> bool:
        """RNG state comes back only with every registered entry: a model-only restore keeps the run's RNG."""
        return len(self.entries) == len(self.registered)


def select_entries(entries: list[Entry], names: Iterable[str] | None = None, strict: bool = True) -> Selection:
    """The :class:`Selection` of ``names`` (None: every registered entry) among ``entries``.

    Raises:
        ConfigError: ``names`` is a string, or names an entry that is not registered.
    """
    registered = tuple(e.name for e in entries)
    if names is None:
        return Selection(tuple(entries), registered, bool(strict), read_all=True)
    if isinstance(names, (str, bytes)):
        raise ConfigError(f"entries={names!r} is a string; pass a list of state names, e.g. entries=[{names!r}]")
    wanted = list(names)
    unknown = [n for n in wanted if n not in registered]
    if unknown:
        raise ConfigError(f"entries= names {', '.join(repr(n) for n in unknown)}, not registered; the registered "
                          f"state names are {list(registered)}")
    return Selection(tuple(e for e in entries if e.name in wanted), registered, bool(strict), read_all=False)


FitOne = Callable[[Entry, Any], tuple[Any, "str | None"]]
"""``fit_one(entry, stored value) -> (value to load, what is left or None)``; raises StateMismatchError."""


class KeySubset(OrderedDict):  # type: ignore[type-arg]
    """A module's stored state cut to the keys a non-strict restore loads; loaded with
    ``load_state_dict(strict=False)`` (the live module's other keys stay as they are)."""


@dataclass
class Fitted:
    """What a restore applies, after :func:`fit_values`."""

    entries: list[Entry] = field(default_factory=list)
    """The chosen entries the checkpoint holds, in registration order."""
    values: dict[str, Any] = field(default_factory=dict)
    """Entry name -> value to load (a :class:`KeySubset` for a module restored key by key)."""
    left: list[str] = field(default_factory=list)
    """What ``strict=False`` left as it is or ignored, one phrase each, for the restore's one warning."""


def fit_values(selection: Selection, values: Mapping[str, Any], source: str,
               saved_classes: Mapping[str, str | None] | None = None,
               available: Iterable[str] | None = None, fit_one: FitOne | None = None) -> Fitted:
    """Refuse before touching anything when the chosen live state cannot take the stored values.

    Args:
        values: stored values by entry name (at least the chosen entries the checkpoint holds).
        source: the checkpoint in messages: ``"step 10"``, or a path.
        saved_classes: the class each entry had when saved (the manifest's ``class_name``): an
            optimizer, scheduler, scaler or other stateful object of another class is refused.
        available: every entry name the checkpoint holds (default: ``values``' names).
        fit_one: ``fit_one(entry, value) -> (value to load, note or None)`` for each chosen entry the
            checkpoint holds, instead of the single-process checks (the distributed runtime's own).

    Raises:
        StateMismatchError: a chosen entry is missing (strict) or cannot take its value.
    """
    held = sorted(values if available is None else available)
    out = Fitted()
    missing = []
    for e in selection.entries:
        if e.name not in values:
            if selection.strict:
                raise StateMismatchError(f"checkpoint {source} has no entry {e.name!r} (it holds {held}); register "
                                         "the same state names that were saved, or restore with strict=False")
            missing.append(e.name)
            continue
        value = values[e.name]
        if fit_one is not None:
            value, note = fit_one(e, value)
            if note:
                out.left.append(note)
        elif e.kind == "module":
            value, note = fit_module(e, unwrap_module(e.obj).state_dict(), value, source, selection.strict)
            if note:
                out.left.append(note)
        else:
            _check_entry(e, value, source, (saved_classes or {}).get(e.name), selection.strict)
        out.entries.append(e)
        out.values[e.name] = value
    if missing:
        out.left.insert(0, f"{source} has no {_names(missing)}; left as {'it is' if len(missing) == 1 else 'they are'}")
    if not selection.strict and selection.read_all:
        extra = [n for n in held if n not in selection.registered and n not in RESERVED_KEYS]
        if extra:
            out.left.append(f"{source} holds {_names(extra)}, not registered; ignored")
    return out


def check_compatible(entries: list[Entry], values: Mapping[str, Any], step: int,
                     saved_classes: Mapping[str, str | None] | None = None) -> None:
    """:func:`fit_values` of every entry, strict: raise when the live state cannot take the stored values."""
    fit_values(select_entries(entries), values, f"step {step}", saved_classes)


def fit_module(e: Entry, live: Mapping[str, Any], stored: Any, source: str, strict: bool) -> tuple[Any, str | None]:
    """``(value to load, what is left or None)`` for the module entry ``e`` with live state ``live``.

    Strict: the keys and every tensor's shape must match. Either way a tensor subclass (a quantized
    tensor) is restored only into the same class, never into a plain tensor or another class. Not strict: the keys both sides hold with
    one shape, as a :class:`KeySubset` when that is not all of them (see the module docstring).
    """
    name, cls = f"state[{e.name!r}]", e.class_name or type(e.obj).__name__
    if not isinstance(stored, Mapping):
        raise StateMismatchError(f"{name} ({cls}): {source} holds a {type(stored).__name__}, "
                                 "not a module's state dict")
    missing = [k for k in live if k not in stored]
    extra = [k for k in stored if k not in live]
    reshaped = [k for k in live if k in stored and stored_shape(live[k]) is not None
                and stored_shape(stored[k]) is not None and stored_shape(live[k]) != stored_shape(stored[k])]
    for k in live:
        if k not in stored:
            continue
        saved = _subclass_of(stored[k])
        # a DTensor's local subclass must match a whole saved one (a full-mode value into FSDP2's shards); a
        # plain saved value may go into it (the float8 all-gather weight wraps its plain master weight)
        mine = _subclass_of(live[k], local=saved is not None)
        if mine != saved:
            raise StateMismatchError(f"{name} key {k!r}: the live tensor is {mine or 'a plain tensor'}, "
                                     f"{source} holds {saved or 'a plain tensor'}; build the model "
                                     "with the quantization it was saved with (or load(..., dequantize=True))")
    if strict:
        if missing or extra:
            raise StateMismatchError(f"{name} ({cls}) does not match {source}: missing keys "
                                     f"{missing[:5]}, unexpected keys {extra[:5]}; restore with strict=False to load "
                                     "the keys both hold")
        if reshaped:
            k = reshaped[0]
            raise StateMismatchError(f"{name} key {k!r}: live shape {stored_shape(live[k])}, saved "
                                     f"{stored_shape(stored[k])} at {source}")
        return stored, None
    if not (missing or extra or reshaped):
        return stored, None
    skip = set(reshaped)
    subset = KeySubset((k, v) for k, v in stored.items() if k in live and k not in skip)
    meta = getattr(stored, "_metadata", None)
    if meta is not None:
        subset._metadata = meta  # type: ignore[attr-defined]  # versions for _load_from_state_dict
    parts = []
    if reshaped:
        shapes = [f"{k!r} (live {stored_shape(live[k])}, saved {stored_shape(stored[k])})" for k in reshaped]
        parts.append(f"{_names(shapes, 'key', quote=False)} of another shape")
    if missing:
        parts.append(f"{_names(missing, 'key')} missing from {source}")
    note = f"{name} ({cls}): " + " and ".join(parts) + (" left as they are" if parts else "")
    if extra:
        note += ("; " if parts else "") + f"saved {_names(extra, 'key')} not in the module ignored"
    return subset, note


def _subclass_of(v: Any, *, local: bool = False) -> str | None:
    """The qualified class of a stored tensor subclass (a quantized tensor), with ``local`` also of a DTensor's
    local tensor; None for anything else."""
    if local and is_dtensor(v):
        v = getattr(v, "_local_tensor", None)
    return qualname(type(v)) if is_stored_subclass(v) else None


def _names(names: list[Any], what: str = "entr", quote: bool = True) -> str:
    """``entry 'a'`` / ``entries 'a', 'b'`` / ``keys 'x', 'y' and 3 more``."""
    shown = ", ".join(repr(n) if quote else str(n) for n in names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    if what == "entr":
        return f"{'entry' if len(names) == 1 else 'entries'} {shown}"
    return f"{what}{'' if len(names) == 1 else 's'} {shown}"


def _check_entry(e: Entry, v: Any, source: str, saved: str | None, strict: bool) -> None:
    """The checks of one non-module entry; ``strict=False`` relaxes none of them (see the module docstring)."""
    if saved and e.kind in ("optimizer", "scheduler", "scaler", "stateful") and saved != type(e.obj).__name__:
        raise StateMismatchError(
            f"state[{e.name!r}] is a {type(e.obj).__name__}, but {source} saved a {saved}; "
            f"build a {saved} to resume from this checkpoint (its state does not fit a {type(e.obj).__name__})"
        )
    if e.kind == "optimizer":
        live_sizes = [len(g["params"]) for g in e.obj.param_groups]
        groups = v.get("param_groups") if isinstance(v, dict) else None
        saved_sizes = [len(g.get("params", ())) for g in groups] if isinstance(groups, list) else None
        if saved_sizes != live_sizes:
            raise StateMismatchError(
                f"state[{e.name!r}] ({type(e.obj).__name__}): live parameter groups of sizes {live_sizes}, "
                f"saved {saved_sizes} at {source}; build the optimizer over the same parameters that were saved"
                + ("" if strict else f" (strict=False does not apply inside an optimizer: leave {e.name!r} out of "
                                     "entries= to keep the live optimizer state)"))
    elif e.kind == "tensor":
        if not isinstance(v, torch.Tensor) or v.shape != e.obj.shape:
            got = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            raise StateMismatchError(f"state[{e.name!r}]: live tensor shape {tuple(e.obj.shape)}, saved {got} at {source}")
    elif e.kind == "data":
        if type(v) is not type(e.obj) and not (isinstance(v, dict) and isinstance(e.obj, dict)):
            raise StateMismatchError(f"state[{e.name!r}]: live {type(e.obj).__name__}, saved {type(v).__name__} at {source}")


def apply_entry(e: Entry, value: Any) -> None:
    """Load one stored value into its live object, in place (a module's :class:`KeySubset`: its keys only)."""
    if e.kind == "module":
        unwrap_module(e.obj).load_state_dict(value, strict=not isinstance(value, KeySubset))
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


__all__ = ["Fitted", "KeySubset", "Selection", "apply_entry", "check_compatible", "fit_module", "fit_values",
           "match_optimizer_state_layout", "select_entries"]
