"""Sharded checkpoints of DTensors whose local tensors are tensor subclasses, read back.

Each stored block is one rank's local subclass (torchao's ``NF4Tensor`` under FSDP2, the float8
all-gather weight), stored bit-exactly through its inner tensors (:mod:`checkpointd.format.sharding`).
A :class:`ShardedSubclassLeaf` restores it three ways:

- **same layout** (a stored block has exactly the live local tensor's offsets and shape, and the same
  flatten context): that block's inner tensors are copied into the live local subclass's inner
  tensors in place (their storages stay; optimizers and modules keep their references). Bit-exact,
  and it needs nothing from the class beyond ``__tensor_flatten__``.
- **another layout** (world size or mesh changed): the class's inner-sharding rule
  (:mod:`checkpointd.format.subclass_sharding`) says which inner rows the live rows hold; those are
  copied from the stored blocks into the live inner tensors. A class without a rule, a target that cuts
  the class's groups, or another config is refused with a StateMismatchError before anything is copied
  into that tensor.
- **from a whole value** (a full-mode checkpoint restored into a DTensor whose local tensor is of the
  same class, FSDP2 over NF4): the whole stored subclass is seen as one block covering every row
  (:class:`WholeSubclassLeaf`, :func:`rows_source`), so each rank copies its rows of the inner tensors
  by the class's rule, as above, not through the class's ``copy_`` of an outer slice (which may
  re-quantize, or refuse the slice: NF4 slices only from row 0 to the end). A class without a rule
  keeps that ``copy_`` path.
- **whole** (``checkpointd.load``, a single-process restore): one block is the stored object itself;
  several are concatenated by the rule and rebuilt with the class's ``__tensor_unflatten__`` (accepted
  classes only). ``dequantize=True`` instead assembles the blocks' dequantized values, which works
  without a rule.

Every block read is checked to be a subclass of the class the manifest names, and an accepted one.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from checkpointd.errors import CorruptCheckpointError, StateMismatchError, UnacceptedSubclassError
from checkpointd.format.dequantize import dequantize_tree
from checkpointd.format.sharding import ShardedLeaf, is_dtensor, plan_copy
from checkpointd.format.subclass_sharding import REPLICATED, ROWS, InnerSharding, inner_rows, no_rule, row_blocks, rule_for
from checkpointd.format.subclasses import accepted_class, is_stored_subclass, local_description, qualname, refusal
from checkpointd.restore.inner_copies import NotInPlace, comparable, inner_pairs, on_device

Pair = tuple[torch.Tensor, torch.Tensor]


class ShardedSubclassLeaf(ShardedLeaf):
    """A stored DTensor whose blocks are tensor subclasses of one class (the record's ``"subclass"``)."""

    def __init__(self, name: str, key: str, record: dict[str, Any], read_blocks: Any) -> None:
        super().__init__(name, key, record, read_blocks)
        part = record.get("subclass")
        if not isinstance(part, dict) or not isinstance(part.get("class"), str) or not isinstance(part.get("inner"), dict):
            raise CorruptCheckpointError(f"entry {name!r} tensor {key}: the manifest's subclass record is malformed")
        self.class_name: str = part["class"]
        self.dequantized: dict[str, str] | None = None
        """When set, :meth:`full` gives the blocks' dequantized values assembled (``checkpointd.load(...,
        dequantize=True)``) and adds ``{key path: class}`` to it."""

    @property
    def where(self) -> str:
        return f"entry {self.name!r} tensor {self.key}"

    def stored_block(self, block: dict[str, Any]) -> torch.Tensor:
        """The stored local subclass of ``block``, checked to be an accepted object of the recorded class
        (a plain tensor for a block the manifest says was stored plain)."""
        obj = self.block_value(block)
        cls = accepted_class(self.class_name) if not block.get("plain") else torch.Tensor
        if cls is None:
            raise UnacceptedSubclassError(refusal(self.class_name, self.where))
        if type(obj) is not cls:
            got = qualname(type(obj)) if isinstance(obj, torch.Tensor) else type(obj).__name__
            raise CorruptCheckpointError(f"{self.where}: rank {block['rank']}'s block is a {got}, the manifest says "
                                         f"{qualname(cls)}")
        if tuple(obj.shape) != tuple(block["shape"]):
            raise CorruptCheckpointError(f"{self.where}: rank {block['rank']}'s block has shape {tuple(obj.shape)}, "
                                         f"the manifest says {tuple(block['shape'])}")
        return obj

    # -- into a live local subclass --------------------------------------------------------------
    def plan_to(self, target: torch.Tensor, offsets: tuple[int, ...], shape: tuple[int, ...], where: str) -> Callable[[], None]:
        """A function copying the stored region ``[offsets, offsets + shape)`` into the live local subclass
        ``target`` in place; the blocks are read and every check is made now."""
        pairs = self.pairs_for(target, offsets, shape, where)

        def copy() -> None:
            with torch.no_grad():
                for dst, src in pairs:
                    dst.copy_(src)

        return copy

    def pairs_for(self, target: torch.Tensor, offsets: tuple[int, ...], shape: tuple[int, ...], where: str) -> list[Pair]:
        """The (live inner, stored values) pairs restoring ``target``; nothing is copied yet.

        Raises:
            StateMismatchError: ``target`` is not of the stored class, another config, or a reshard the
                class's rule does not allow (or it has no rule).
        """
        same = [b for b in self.record["blocks"] if tuple(b["offsets"]) == tuple(offsets) and tuple(b["shape"]) == tuple(shape)]
        plain = bool(same) and bool(same[0].get("plain"))  # this block was stored as a plain tensor
        if plain and type(target) is torch.Tensor:  # stored plain, live plain: this block as it is
            return [(target, self.stored_block(same[0]))]
        if not same:
            self._not_mixed(where)
        if plain or qualname(type(target)) != self.class_name or not is_stored_subclass(target):
            held = f"a plain tensor for this block, {self.class_name} for others" if plain else f"{self.class_name} blocks"
            raise StateMismatchError(f"{where}: the live local tensor is a {qualname(type(target))}, the checkpoint holds "
                                     f"{held}; build the model with the quantization that was saved")
        if target.dtype != self.dtype:
            raise StateMismatchError(f"{where}: live {type(target).__name__} of dtype {target.dtype}, saved {self.dtype}")
        rule = rule_for(self.class_name)
        if same:
            try:
                return inner_pairs(target, self.stored_block(same[0]), where)
            except NotInPlace as why:
                if rule is None:  # with a rule, the size-dependent parts of the context may differ (NF4's n_blocks)
                    raise StateMismatchError(f"{where}: the live {type(target).__name__} cannot take the saved block in "
                                             f"place ({why}); build the model with the quantization that was saved") from None
        if rule is None:
            raise no_rule(self.class_name, where, self.record.get("mesh_shape"))
        return self._resharded_pairs(target, rule, offsets, shape, where)

    def _resharded_pairs(self, target: torch.Tensor, rule: InnerSharding, offsets: tuple[int, ...],
                         shape: tuple[int, ...], where: str) -> list[Pair]:
        full_shape = tuple(self.shape)
        if list(offsets[1:]) != [0] * (len(full_shape) - 1) or tuple(shape[1:]) != full_shape[1:]:
            raise StateMismatchError(f"{where}: the live local tensor is not whole rows of the global one; "
                                     f"only a row split (Shard(0)) of a {self.class_name} can be resharded")
        self.blocks_for(offsets, shape)  # the stored blocks cover the region, or CorruptCheckpointError
        self._not_mixed(where)
        blocks = row_blocks(self.record, rule, where)
        rows = (offsets[0], offsets[0] + shape[0])
        touched = [b for b in blocks if b.rows[0] < rows[1] and rows[0] < b.rows[1]]
        stored = {id(b.block): self.stored_block(b.block) for b in touched}
        names, ctx = target.__tensor_flatten__()
        first = stored[id(touched[0].block)]
        _, s_ctx = first.__tensor_flatten__()
        size, stride = tuple(target.shape), tuple(target.stride())
        if comparable(rule.ctx_for(ctx, size, stride)) != comparable(rule.ctx_for(s_ctx, size, stride)):
            raise StateMismatchError(f"{where}: the live {type(target).__name__}'s flatten context (quantization config) "
                                     "differs from the saved one; build the model with the quantization that was saved")
        if set(names) != set(self.record["subclass"]["inner"]):
            raise StateMismatchError(f"{where}: live inner tensors {sorted(names)}, saved {sorted(self.record['subclass']['inner'])}")
        pairs: list[Pair] = []
        for n in names:
            dst = getattr(target, n).detach()
            kind = rule.inner.get(n)
            if kind == REPLICATED:
                src = _replicated(n, [getattr(stored[id(b.block)], n) for b in touched], where)
            elif kind == ROWS:
                lo, hi = inner_rows(self.record, n, rows, where)
                parts = []
                for b in touched:
                    a, z = max(lo, b.inner[n][0]), min(hi, b.inner[n][1])
                    parts.append(getattr(stored[id(b.block)], n)[a - b.inner[n][0]:z - b.inner[n][0]])
                src = torch.cat(parts) if len(parts) > 1 else parts[0]
            else:
                raise StateMismatchError(f"{where}: inner tensor {n!r} of {self.class_name} has no inner-sharding rule")
            if tuple(dst.shape) != tuple(src.shape) or dst.dtype != src.dtype:
                raise StateMismatchError(f"{where}: live inner {n!r} is {tuple(dst.shape)} {dst.dtype}, the saved blocks "
                                         f"give {tuple(src.shape)} {src.dtype} for rows [{rows[0]}, {rows[1]})")
            pairs.append((dst, src))
        return pairs

    # -- whole ------------------------------------------------------------------------------------
    def region(self, offsets: tuple[int, ...], shape: tuple[int, ...], out: torch.Tensor | None = None) -> torch.Tensor:
        """Refused: a region of a tensor subclass is not a plain tensor (slicing would dequantize)."""
        raise StateMismatchError(f"{self.where}: holds {self.class_name} blocks, which restore only into live "
                                 f"{self.class_name} tensors (or whole, with checkpointd.load)")

    def full(self) -> torch.Tensor:
        """The whole global tensor: the global subclass (accepted classes), or plain if :attr:`dequantized`.

        Raises:
            StateMismatchError: several blocks of a class without an inner-sharding rule (not dequantized).
        """
        blocks = sorted(self.record["blocks"], key=lambda b: b["offsets"])
        covered = sum(math.prod(b["shape"]) for b in blocks)
        if covered != math.prod(self.shape):
            self.blocks_for(tuple(0 for _ in self.shape), self.shape)  # raises: the checkpoint is incomplete
        if self.dequantized is not None:
            return self._dequantized(blocks, self.dequantized)
        self._not_mixed(self.where)
        if len(blocks) == 1:
            return self.stored_block(blocks[0])
        rule = rule_for(self.class_name)
        if rule is None:
            raise no_rule(self.class_name, self.where, self.record.get("mesh_shape"))
        rows = row_blocks(self.record, rule, self.where)
        stored = [self.stored_block(b.block) for b in rows]
        cls = type(stored[0])
        names, ctx = stored[0].__tensor_flatten__()
        inner: dict[str, torch.Tensor] = {}
        for n in names:
            values = [getattr(s, n) for s in stored]
            inner[n] = _replicated(n, values, self.where).clone() if rule.inner.get(n) == REPLICATED else torch.cat(values)
        size = torch.Size(self.shape)
        stride = _contiguous_strides(size)
        return cls.__tensor_unflatten__(inner, on_device(rule.ctx_for(ctx, tuple(size), stride), torch.device("cpu")),
                                        size, stride)

    def _not_mixed(self, where: str) -> None:
        """Refuse to assemble or reshard blocks of which some were stored plain (:func:`merge_records`)."""
        plain = [b["rank"] for b in self.record["blocks"] if b.get("plain")]
        if plain:
            raise StateMismatchError(
                f"{where}: the ranks stored different local types ({self.class_name} blocks, plain tensors on ranks "
                f"{plain}: uneven shards on either side of the quantization's minimum size), which restore only onto "
                "the same blocks (the same mesh and world size), or whole with checkpointd.load(..., dequantize=True)")

    def _dequantized(self, blocks: list[dict[str, Any]], done: dict[str, str]) -> torch.Tensor:
        """The blocks dequantized by their class (:mod:`checkpointd.format.dequantize`), assembled (not bit-exact).

        A row of a block depends on that block's inner tensors only for every built-in class, so this
        equals dequantizing the whole tensor; it needs no inner-sharding rule.
        """
        out: torch.Tensor | None = None
        for b in blocks:
            plain = dequantize_tree(self.stored_block(b), (self.name, self.key), {})
            if out is None:
                out = torch.empty(self.shape, dtype=plain.dtype)
            out[tuple(slice(o, o + s) for o, s in zip(b["offsets"], b["shape"]))] = plain
        assert out is not None
        done[f"{self.name}/{self.key}"] = self.class_name
        return out


def _replicated(name: str, values: list[torch.Tensor], where: str) -> torch.Tensor:
    """The one value of a replicated inner tensor; refused when the blocks disagree."""
    first = values[0]
    for v in values[1:]:
        if v.shape != first.shape or v.dtype != first.dtype or not torch.equal(_bytes(v), _bytes(first)):
            raise StateMismatchError(f"{where}: the stored blocks' inner tensor {name!r} differ, but its inner-sharding "
                                     "rule says it is replicated; the rule does not describe this class")
    return first


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (float8 has no ``torch.equal`` on the CPU; NaN payloads compare too)."""
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def _contiguous_strides(size: torch.Size) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(size):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


class WholeSubclassLeaf(ShardedSubclassLeaf):
    """A whole stored tensor subclass (a full-mode value) as a sharded leaf of one block covering every row.

    Its :meth:`plan_to` gives a live local subclass its rows of the inner tensors by the class's
    inner-sharding rule (refusing rows that cut a group), as a resharded sharded checkpoint does.
    """

    def __init__(self, value: torch.Tensor, where: str) -> None:
        """Raises ValueError: an inner tensor of ``value`` is itself a subclass (nested: not described)."""
        class_part, block_part = local_description(value)
        record = {"global_shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch."),
                  "subclass": class_part, "mesh_shape": None,
                  "blocks": [{"rank": 0, "offsets": [0] * value.dim(), "shape": list(value.shape), **block_part}]}
        super().__init__(where, "[]", record, lambda _rank: {"[]": value})
        self._where = where

    @property
    def where(self) -> str:
        return self._where


def rows_source(live: Any, stored: Any, where: str) -> Any:
    """What ``live`` takes ``stored`` from: a :class:`WholeSubclassLeaf` when ``live`` is a DTensor whose local
    tensor is of the class of ``stored``, a whole stored subclass whose class has an inner-sharding rule;
    otherwise ``stored`` itself (the outer tensor's slice and ``copy_``)."""
    if not (is_dtensor(live) and is_stored_subclass(stored) and type(live._local_tensor) is type(stored)
            and rule_for(qualname(type(stored))) is not None):
        return stored
    try:
        return WholeSubclassLeaf(stored, where)
    except ValueError:  # nested subclasses: the class's own copy_
        return stored


def plan_copy_into(live: torch.Tensor, stored: Any, where: str) -> Callable[[], None]:
    """:func:`checkpointd.format.sharding.plan_copy` of ``stored`` into ``live``, from its :func:`rows_source`."""
    return plan_copy(live, rows_source(live, stored, where), where)


def leaf_for(name: str, key: str, record: dict[str, Any], read_blocks: Any) -> ShardedLeaf:
    """The leaf reading one stored tensor: a :class:`ShardedSubclassLeaf` when its blocks are subclasses."""
    if "subclass" in record:
        return ShardedSubclassLeaf(name, key, record, read_blocks)
    return ShardedLeaf(name, key, record, read_blocks)


def dequantize_leaves(tree: Any, done: dict[str, str]) -> None:
    """Make every :class:`ShardedSubclassLeaf` of ``tree`` assemble dequantized values, noting them in ``done``."""
    if isinstance(tree, ShardedSubclassLeaf):
        tree.dequantized = done
    elif isinstance(tree, dict):
        for v in tree.values():
            dequantize_leaves(v, done)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            dequantize_leaves(v, done)


__all__ = ["ShardedSubclassLeaf", "WholeSubclassLeaf", "dequantize_leaves", "leaf_for", "plan_copy_into",
           "rows_source"]
