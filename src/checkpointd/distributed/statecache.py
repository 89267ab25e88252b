"""Sharded-mode state dicts without re-running PyTorch's state-dict machinery on every save.

Why: under torch.distributed, ``get_model_state_dict``/``get_optimizer_state_dict`` walk the whole
module, rebuild FQN maps and (optimizer) translate parameter ids into FQNs on every call. With a few
hundred parameters that is tens of milliseconds of the training thread per save, yet between two
saves of a training run nothing they compute changes: FSDP2 keeps the same sharded parameter
objects, and optimizers update their state tensors in place.

So after one full call (the *reference*), each cache learns a *plan*: which live object sits behind
every output key, in the output's order. A later save rebuilds the same tree from the plan after a
cheap check that the plan still holds; anything else takes the full call again, which re-learns.

What is checked on every save (all identity checks; the cache holds strong references, so ``id`` is
never reused by another object while it is compared):

- module: every submodule's type, parameter/buffer/child names and objects, non-persistent buffer set
  and state-dict hook lists are unchanged (state-dict *pre*-hooks, e.g. FSDP2's "reshard before
  saving", are run first, exactly as ``state_dict()`` runs them);
- optimizer: the same ``optimizer.state`` mapping with the same parameters in the same order, the same
  parameter objects in every param group, no state-dict hooks, and the owner module's structure.

What is never cached: values. The tree holds the live parameters/buffers and the live per-parameter
optimizer state dicts (as ``Optimizer.state_dict`` does), and param-group hyperparameters are copied
at every save, so an ``lr`` changed by a scheduler or non-tensor optimizer state is always current.

A plan is only used if, when learned, rebuilding from it reproduced the reference exactly (same keys
in the same order, the same live objects or views of the same memory); otherwise that object simply
keeps the full path. Not cached at all: FSDP1 (gathered even in sharded mode), full mode (collective),
modules with state-dict post-hooks or custom ``state_dict``/``_save_to_state_dict``/``get_extra_state``,
optimizers with state-dict hooks or a custom ``state_dict``, and optimizers without state yet (the
full path initialises it).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any, Callable

import torch

from checkpointd.errors import CheckpointError
from checkpointd.format.sharding import is_dtensor
from checkpointd.format.subclasses import is_stored_subclass
from checkpointd.distributed.state_dicts import is_fsdp1

logger = logging.getLogger("checkpointd")

VERIFY_PLANS = False
"""True: also run the full path on every cache hit and raise if the trees differ (tests, debugging).
Read when a manager's runtime is built: set it before constructing the CheckpointManager."""


class LocalStates:
    """The sharded-mode state tree of each registered entry, from a cache where one holds.

    One instance per DistributedRuntime. ``begin()`` once per save (a token: structure checks shared
    by the caches run once per save), then ``state(entry, full_call)`` per entry.
    """

    def __init__(self, entries: list[Any], owner: dict[str, torch.nn.Module | None]) -> None:
        self.enabled = True
        self.verify = VERIFY_PLANS
        self.counts: dict[str, list[int]] = {}  # name -> [hits, misses] (tests, debugging)
        self._token: object = None
        self._modules: dict[int, ModuleStateCache] = {}
        self._caches: dict[str, Any] = {}
        for e in entries:
            if e.kind == "module":
                self._caches[e.name] = self._modules.setdefault(id(e.obj), ModuleStateCache(e.obj))
        for e in entries:
            model = owner.get(e.name)
            if e.kind == "optimizer" and model is not None:
                self._caches[e.name] = OptimizerStateCache(e.obj, model, self._module_watch(model))

    def _module_watch(self, model: torch.nn.Module) -> Callable[[], "StructureWatch | None"]:
        cache = self._modules.get(id(model))
        return lambda: cache.watch if cache is not None else None

    def begin(self) -> None:
        self._token = object()

    def state(self, name: str, full_call: Callable[[], Any]) -> Any:
        """Entry ``name``'s tree: from its cache when valid, else ``full_call()`` (and learn from it)."""
        cache = self._caches.get(name) if self.enabled else None
        if cache is None:
            return full_call()
        tree = cache.lookup(self._token)
        counts = self.counts.setdefault(name, [0, 0])
        if tree is not None:
            counts[0] += 1
            if self.verify:
                reference = full_call()
                problem = tree_difference(tree, reference)
                if problem:
                    raise CheckpointError(f"checkpointd internal error: cached state of {name!r} differs from the full path: {problem}")
            return tree
        counts[1] += 1
        tree = full_call()
        if cache.should_learn(self._token):
            cache.learn(tree)
        return tree


def tree_difference(a: Any, b: Any, where: str = "") -> str | None:
    """Where ``a`` and ``b`` differ as saved state (container types, key order, tensor memory, other values); None if nowhere."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return None if same_view(a, b) else f"{where or '<root>'}: tensors differ"
    if type(a) is not type(b):
        return f"{where or '<root>'}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, dict):
        if list(a) != list(b):
            return f"{where or '<root>'}: keys {list(a)[:6]} vs {list(b)[:6]}"
        for k in a:
            problem = tree_difference(a[k], b[k], f"{where}[{k!r}]")
            if problem:
                return problem
        return None
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"{where or '<root>'}: lengths {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            problem = tree_difference(x, y, f"{where}[{i}]")
            if problem:
                return problem
        return None
    return None if a is b or a == b else f"{where or '<root>'}: {a!r} vs {b!r}"


class StructureWatch:
    """Cheap per-save check that a module tree's structure (names -> objects) is what it was."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._modules = list({id(m): m for m in model.modules()}.values())
        self._sigs = [self._sig(m) for m in self._modules]
        self._checked_token: object = None
        self._ok = True

    @staticmethod
    def _sig(m: torch.nn.Module) -> tuple[Any, ...]:
        return (type(m), tuple(m._parameters), tuple(map(id, m._parameters.values())),
                tuple(m._buffers), tuple(map(id, m._buffers.values())),
                tuple(m._modules), tuple(map(id, m._modules.values())),
                frozenset(m._non_persistent_buffers_set),
                tuple(m._state_dict_pre_hooks), tuple(m._state_dict_hooks))

    def unchanged(self, token: object) -> bool:
        """True if nothing changed; computed once per ``token`` (one save) however many caches ask."""
        if token is not self._checked_token or token is None:
            self._ok = all(self._sig(m) == s for m, s in zip(self._modules, self._sigs))
            self._checked_token = token
        return self._ok


class ModuleStateCache:
    """``get_model_state_dict(model, full_state_dict=False)`` from a learned plan while the module is unchanged."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.watch: StructureWatch | None = None
        self._keys: list[str] = []
        self._values: list[torch.Tensor] = []
        self._detach: list[int] = []
        self._pre_hooks: list[tuple[torch.nn.Module, str]] = []
        self.eligible = True

    def lookup(self, token: object) -> "OrderedDict[str, Any] | None":
        """The state dict from the plan, or None (no plan, or the module changed)."""
        if self.watch is None or not self.eligible:
            return None
        with torch.no_grad():
            for m, prefix in self._pre_hooks:
                for hook in list(m._state_dict_pre_hooks.values()):
                    hook(m, prefix, False)
        if not self.watch.unchanged(token):
            return None
        if not self._detach:
            return OrderedDict(zip(self._keys, self._values))
        values = list(self._values)
        for i in self._detach:  # as state_dict() gives them: a subclass's detach may drop caches (see learn)
            values[i] = values[i].detach()
        return OrderedDict(zip(self._keys, values))

    def learn(self, reference: dict[str, Any]) -> None:
        """Learn a plan from a full call's output; keep none if rebuilding would not reproduce it."""
        self.watch, self.eligible = None, True
        try:
            plan = _module_plan(self.model, reference)
        except Exception as exc:  # noqa: BLE001 - a torch-internal surprise only costs the fast path
            logger.debug("checkpointd: no state-dict plan for %s (%s: %s)", type(self.model).__name__, type(exc).__name__, exc)
            plan = None
        if plan is None:
            self.eligible = False
            self.watch = StructureWatch(self.model)  # re-learn only after the structure changes
            return
        self._keys, self._values, self._pre_hooks = plan
        # A parameter whose (local) tensor is a subclass goes through its class's detach, as in state_dict():
        # torchao's float8 all-gather weight drops its precomputed scale there, so the plan's value and a full
        # call's give the same inner tensors.
        self._detach = [i for i, v in enumerate(self._values)
                        if is_stored_subclass(v._local_tensor if is_dtensor(v) else v)]
        self.watch = StructureWatch(self.model)

    def should_learn(self, token: object) -> bool:
        """False while an ineligible module keeps its structure (learning again would fail again)."""
        return self.eligible or self.watch is None or not self.watch.unchanged(token)


def _module_plan(model: torch.nn.Module, reference: dict[str, Any]) -> tuple[list[str], list[torch.Tensor], list[tuple[torch.nn.Module, str]]] | None:
    from torch.distributed.checkpoint.state_dict import _get_fqns

    if is_fsdp1(model):
        return None  # gathered even in sharded mode
    base = torch.nn.Module
    raw: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    pre_hooks: list[tuple[torch.nn.Module, str]] = []
    for name, m in model.named_modules(remove_duplicate=False):
        cls = type(m)
        if (m._state_dict_hooks or cls.state_dict is not base.state_dict or cls._save_to_state_dict is not base._save_to_state_dict
                or cls.get_extra_state is not base.get_extra_state):
            return None
        prefix = f"{name}." if name else ""
        if m._state_dict_pre_hooks:
            pre_hooks.append((m, prefix))
        for n, p in m._parameters.items():
            if p is not None:
                raw[prefix + n] = p
        for n, b in m._buffers.items():
            if b is not None and n not in m._non_persistent_buffers_set:
                raw[prefix + n] = b
    # get_model_state_dict renames wrapper-prefixed keys to FQNs, moving each renamed key to the end.
    keyed: "OrderedDict[str, torch.Tensor]" = OrderedDict(raw)
    for key in list(keyed):
        fqns = _get_fqns(model, key)
        if len(fqns) != 1:
            return None
        fqn = next(iter(fqns))
        if fqn != key:
            keyed[fqn] = keyed.pop(key)
    if list(keyed) != list(reference) or not all(same_view(reference[k], v) for k, v in keyed.items()):
        return None
    return list(keyed), list(keyed.values()), pre_hooks


class OptimizerStateCache:
    """``get_optimizer_state_dict(model, optimizer, full_state_dict=False)`` from a learned plan.

    The plan is the FQN of every parameter; the values (per-parameter state dicts, group
    hyperparameters) are read from the optimizer at every save.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module,
                 module_watch: Callable[[], StructureWatch | None]) -> None:
        self.optimizer = optimizer
        self.model = model
        self._module_watch = module_watch  # the owner module cache's watch, shared when current
        self._watch: StructureWatch | None = None  # the owner's structure when the plan was learned (FQNs)
        self._state_obj: Any = None
        self._state_ids: list[int] = []
        self._state_params: list[torch.Tensor] = []  # strong refs: the ids above stay unique
        self._state_fqns: list[str] = []
        self._groups: list[tuple[list[int], list[str]]] = []
        self._group_params: list[list[torch.Tensor]] = []

    def lookup(self, token: object) -> dict[str, Any] | None:
        opt = self.optimizer
        watch = self._watch
        if (self._state_obj is None or opt.state is not self._state_obj or watch is None or not _plain_optimizer(opt)
                or len(opt.state) != len(self._state_ids) or len(opt.param_groups) != len(self._groups)):
            return None
        state: dict[str, Any] = {}
        for (p, st), pid, fqn in zip(opt.state.items(), self._state_ids, self._state_fqns):
            if id(p) != pid:
                return None
            state[fqn] = st
        groups: list[dict[str, Any]] = []
        for g, (ids, fqns) in zip(opt.param_groups, self._groups):
            params = g["params"]
            if len(params) != len(ids) or any(id(p) != i for p, i in zip(params, ids)):
                return None
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = list(fqns)
            groups.append(packed)
        if not watch.unchanged(token):
            return None
        return {"state": state, "param_groups": groups}

    def learn(self, reference: dict[str, Any]) -> None:
        self._state_obj = None
        try:
            ok = self._learn(reference)
        except Exception as exc:  # noqa: BLE001
            logger.debug("checkpointd: no optimizer-state plan (%s: %s)", type(exc).__name__, exc)
            ok = False
        if not ok:
            self._state_obj = None
            return
        shared = self._module_watch()
        self._watch = shared if shared is not None and shared.unchanged(None) else StructureWatch(self.model)

    def should_learn(self, token: object) -> bool:
        return True  # learning is a few dict operations
    def _learn(self, reference: dict[str, Any]) -> bool:
        opt = self.optimizer
        if not opt.state or not _plain_optimizer(opt) or is_fsdp1(self.model) or set(reference) != {"state", "param_groups"}:
            return False
        ref_groups = reference["param_groups"]
        if len(ref_groups) != len(opt.param_groups):
            return False
        fqn_of: dict[int, str] = {}
        groups: list[tuple[list[int], list[str]]] = []
        for g, rg in zip(opt.param_groups, ref_groups):
            params, fqns = list(g["params"]), list(rg["params"])
            if len(params) != len(fqns) or list(rg) != [k for k in g if k != "params"] + ["params"]:
                return False
            if any(rg[k] is not v for k, v in g.items() if k != "params"):
                return False
            for p, f in zip(params, fqns):
                if id(p) in fqn_of or not isinstance(f, str):
                    return False  # a parameter in two groups: leave it to the full path
                fqn_of[id(p)] = f
            groups.append(([id(p) for p in params], fqns))
        keys = list(opt.state)
        if any(not isinstance(p, torch.Tensor) or id(p) not in fqn_of for p in keys):
            return False
        fqns = [fqn_of[id(p)] for p in keys]
        ref_state = reference["state"]
        if list(ref_state) != fqns or any(ref_state[f] is not opt.state[p] for f, p in zip(fqns, keys)):
            return False
        self._state_ids, self._state_params, self._state_fqns = [id(p) for p in keys], keys, fqns
        self._groups = groups
        self._group_params = [list(g["params"]) for g in opt.param_groups]
        self._state_obj = opt.state
        return True


def _plain_optimizer(opt: torch.optim.Optimizer) -> bool:
    """``Optimizer.state_dict`` as PyTorch wrote it, without hooks that could change its output."""
    return (type(opt).state_dict is torch.optim.Optimizer.state_dict
            and not getattr(opt, "_optimizer_state_dict_pre_hooks", None)
            and not getattr(opt, "_optimizer_state_dict_post_hooks", None))


def same_view(a: Any, b: Any) -> bool:
    """True if tensors (or DTensors) ``a`` and ``b`` are views of the same memory with the same layout."""
    if is_dtensor(a) or is_dtensor(b):
        if not (is_dtensor(a) and is_dtensor(b)) or a.placements != b.placements or a.device_mesh != b.device_mesh or a.shape != b.shape:
            return False
        a, b = a._local_tensor, b._local_tensor
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return False
    return (a.device == b.device and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            and a.data_ptr() == b.data_ptr() and a.storage_offset() == b.storage_offset())
