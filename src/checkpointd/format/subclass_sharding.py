"""How a tensor subclass's inner tensors are laid out when its outer tensor is sharded by rows.

A DTensor whose local tensor is a tensor subclass (FSDP2 over torchao's ``NF4Tensor`` or its float8
all-gather weight ``WeightWithDynamicFloat8CastTensor``) is saved as each rank's local subclass, through
its inner tensors. Restoring on the same mesh copies each stored block's inner tensors into the live
ones; nothing needs to be known about the class. Restoring on another mesh (or assembling the global
tensor for ``checkpointd.load``) needs to know how the inner tensors follow the outer rows, which only
the class's author knows: guessing from shapes would silently corrupt data (NF4's scalers are grouped
across rows). That knowledge is an :class:`InnerSharding` rule:

- ``"rows"``: the global inner tensor is the blocks' inner tensors concatenated along its dim 0, in the
  order of the blocks' outer rows; outer rows ``[a, b)`` hold inner rows ``[a*k, b*k)`` with
  ``k = inner rows / outer rows`` (a fraction: NF4's ``quantization_factor`` has one entry per 64 rows
  of a 256-column weight). A target whose ``a*k`` or ``b*k`` is not whole cuts a group and is refused.
- ``"replicated"``: every block holds the whole inner tensor (NF4's lookup table and scaler mean);
  the blocks must agree bit for bit.

Built-in rules cover NF4, the float8 all-gather weight and torchao's low-bit optimizer states
(``OptimState8bit``, ``OptimState4bit``, ``OptimStateFp8``: AdamW8bit, AdamW4bit, AdamWFp8 moments under
FSDP2; their codes and block scales follow the outer rows, a target that cuts a quantization block is
refused), by qualified name: nothing is imported; :func:`register_inner_sharding` adds others. Rules
describe layouts only: a class must still be accepted (:mod:`checkpointd.format.subclasses`) to be rebuilt.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable, Mapping

import torch

from checkpointd.errors import ConfigError, StateMismatchError
from checkpointd.format.subclasses import qualname

ROWS = "rows"
REPLICATED = "replicated"

CtxForShape = Callable[[Any, tuple[int, ...], tuple[int, ...]], Any]
"""``(flatten ctx, outer size, outer stride) -> ctx`` of the same config for a tensor of that size."""


@dataclass(frozen=True)
class InnerSharding:
    """How each inner tensor of a class follows its outer tensor's rows.

    Attributes:
        inner: ``{inner tensor name: "rows" | "replicated"}``; every inner tensor of the class is named.
        ctx_for_shape: rewrites the parts of a flatten context that depend on the outer size (NF4's
            ``tensor_meta`` and ``n_blocks``); None when the context does not depend on it.
    """

    inner: Mapping[str, str]
    ctx_for_shape: CtxForShape | None = None

    def ctx_for(self, ctx: Any, size: tuple[int, ...], stride: tuple[int, ...]) -> Any:
        """The flatten context of this config for an outer tensor of ``size`` and ``stride``."""
        return ctx if self.ctx_for_shape is None else self.ctx_for_shape(ctx, size, stride)


def _nf4_ctx_for_shape(ctx: Any, size: tuple[int, ...], stride: tuple[int, ...]) -> Any:
    """NF4's context for a tensor of ``size``: its ``tensor_meta`` shape and strides, and ``n_blocks``.

    (A shard keeps the global ``n_blocks`` and its own shape; ``to_nf4`` sets ``numel // block_size``.)
    """
    out = dict(ctx)
    meta = out.get("tensor_meta")
    if dataclasses.is_dataclass(meta) and not isinstance(meta, type):
        out["tensor_meta"] = dataclasses.replace(meta, original_shape=torch.Size(size), original_strides=tuple(stride))
    numel = 1
    for s in size:
        numel *= s
    if isinstance(out.get("block_size"), int) and out["block_size"] > 0:
        out["n_blocks"] = numel // out["block_size"]
    return out


def _optim4bit_ctx_for_shape(ctx: Any, size: tuple[int, ...], stride: tuple[int, ...]) -> Any:
    """torchao's ``OptimState4bit`` context ``[signed, shape, dtype]`` for a tensor of ``size``.

    (Its codes are a flat buffer, so the outer shape is kept in the context: a shard holds its own.)
    """
    if isinstance(ctx, (list, tuple)) and len(ctx) == 3 and isinstance(ctx[1], (tuple, list)):
        out = list(ctx)
        out[1] = torch.Size(size)
        return type(ctx)(out)
    return ctx


# torchao.optim's low-bit optimizer states quantize the parameter flattened, in blocks of ``block_size``
# consecutive elements (``codes.numel() // scale.numel()``, 4-bit: ``* 2``): outer rows [a, b) of a tensor
# with ``C`` elements a row hold flat elements [a*C, b*C), that is codes [a*C, b*C) (8-bit, fp8: the
# codes keep the outer shape, so codes rows [a, b); 4-bit: two codes a byte, bytes [a*C/2, b*C/2)) and
# scales [a*C/block_size, b*C/block_size). Every part is a contiguous proportional range: "rows", and a
# target that cuts a block (or a byte) is refused. qmap, the code -> value table, is in every block.
_OPTIM_STATE = {"codes": ROWS, "scale": ROWS, "qmap": REPLICATED}

RULES: dict[str, InnerSharding] = {
    "torchao.quantization.quantize_.workflows.nf4.nf4_tensor.NF4Tensor": InnerSharding(
        {"quantized_data": ROWS, "quantization_factor": ROWS, "quantized_scalers": ROWS,
         "scaler_mean": REPLICATED, "nf4": REPLICATED},
        _nf4_ctx_for_shape),
    "torchao.float8.fsdp_utils.WeightWithDynamicFloat8CastTensor": InnerSharding(
        {"_tensor": ROWS, "_precomputed_scale": REPLICATED}),
    "torchao.optim.subclass_8bit.OptimState8bit": InnerSharding(_OPTIM_STATE),  # ctx [signed, dtype]
    "torchao.optim.subclass_4bit.OptimState4bit": InnerSharding(_OPTIM_STATE, _optim4bit_ctx_for_shape),
    "torchao.optim.subclass_fp8.OptimStateFp8": InnerSharding({"codes": ROWS, "scale": ROWS}),  # ctx [dtype]
}
"""Inner-sharding rules by qualified class name (built-ins: torchao's NF4, float8 all-gather weight and
low-bit optimizer states)."""


def register_inner_sharding(cls: type, rules: Mapping[str, str], *, ctx_for_shape: CtxForShape | None = None) -> None:
    """Declare how the inner tensors of ``cls`` follow its outer rows, so sharded checkpoints of it reshard.

    Without a rule, a DTensor whose local tensor is a ``cls`` restores only onto the mesh layout it was
    saved from (each rank's blocks as they were), and ``checkpointd.load`` cannot assemble it.

    Args:
        cls: the tensor subclass (it must also be accepted: ``checkpointd.allow_tensor_subclasses``).
        rules: ``{inner tensor name: "rows" | "replicated"}`` for every name ``__tensor_flatten__`` gives.
            ``"rows"``: the global inner tensor is the shards' inner tensors concatenated along dim 0,
            proportionally to the outer rows; ``"replicated"``: each shard holds the whole inner tensor.
        ctx_for_shape: ``(ctx, outer size, outer stride) -> ctx`` rewriting the size-dependent parts of
            the flatten context (used to rebuild the global tensor and to compare configs across sizes).

    Raises:
        ConfigError: not a tensor subclass with ``__tensor_flatten__``, or a rule other than the two.
    """
    if not (isinstance(cls, type) and issubclass(cls, torch.Tensor) and callable(getattr(cls, "__tensor_flatten__", None))):
        raise ConfigError(f"register_inner_sharding({cls!r}): not a tensor subclass implementing __tensor_flatten__")
    bad = {k: v for k, v in rules.items() if not isinstance(k, str) or v not in (ROWS, REPLICATED)}
    if bad or not rules:
        raise ConfigError(f"register_inner_sharding({cls.__name__}): rules map inner tensor names to {ROWS!r} or "
                          f"{REPLICATED!r}; got {dict(rules) if not bad else bad}")
    RULES[qualname(cls)] = InnerSharding(dict(rules), ctx_for_shape)


def rule_for(name: str) -> InnerSharding | None:
    return RULES.get(name)


def no_rule(name: str, where: str, mesh: Any) -> StateMismatchError:
    """The refusal for resharding a class without a rule, with the three ways out."""
    return StateMismatchError(
        f"{where} was saved on mesh {tuple(mesh or ())} with a {name} local tensor; resharding it (another mesh or "
        "world size, or the whole tensor) needs an inner-sharding rule (checkpointd.register_inner_sharding): "
        "restore on the same mesh, register a rule, or load it with checkpointd.load(..., dequantize=True)")


@dataclass(frozen=True)
class RowBlock:
    """One stored block along the outer rows: its outer row range and, per ``"rows"`` inner, its inner rows."""

    block: dict[str, Any]
    rows: tuple[int, int]
    inner: dict[str, tuple[int, int]]


def row_blocks(record: dict[str, Any], rule: InnerSharding, where: str) -> list[RowBlock]:
    """The stored blocks of a subclass tensor as row ranges with their inner row ranges, from the manifest.

    Raises:
        StateMismatchError: blocks not split by rows only (another placement, a 2-D split), an inner
            tensor the rule does not name, or inner rows not proportional to the outer rows.
    """
    shape = tuple(record["global_shape"])
    if not shape:
        raise StateMismatchError(f"{where}: a 0-dim tensor subclass cannot be resharded by rows")
    names = set(record["subclass"]["inner"])
    if names - set(rule.inner):
        raise StateMismatchError(f"{where}: inner tensors {sorted(names - set(rule.inner))} of "
                                 f"{record['subclass']['class']} have no inner-sharding rule")
    blocks = sorted(record["blocks"], key=lambda b: b["offsets"])
    out: list[RowBlock] = []
    for b in blocks:
        if list(b["offsets"][1:]) != [0] * (len(shape) - 1) or tuple(b["shape"][1:]) != shape[1:]:
            raise StateMismatchError(f"{where}: its stored blocks are not whole rows (placements "
                                     f"{record.get('placements')}); only a row split (Shard(0)) can be resharded")
        out.append(RowBlock(b, (b["offsets"][0], b["offsets"][0] + b["shape"][0]), {}))
    rows = [n for n in sorted(names) if rule.inner[n] == ROWS]
    for n in rows:
        total = sum(_inner_rows_of(b.block, n, where) for b in out)
        start = 0
        for b in out:
            count = _inner_rows_of(b.block, n, where)
            if Fraction(b.rows[0] * total, shape[0]) != start or Fraction(b.rows[1] * total, shape[0]) != start + count:
                raise StateMismatchError(f"{where}: inner tensor {n!r} of {record['subclass']['class']} is not split "
                                         "in proportion to the outer rows; the 'rows' rule does not describe it")
            b.inner[n] = (start, start + count)
            start += count
    return out


def inner_rows(record: dict[str, Any], name: str, rows: tuple[int, int], where: str) -> tuple[int, int]:
    """Inner rows ``[a*k, b*k)`` of the inner ``"rows"`` tensor ``name`` for outer rows ``rows``.

    Raises:
        StateMismatchError: the range cuts one of the class's groups (``a*k`` or ``b*k`` not whole).
    """
    total = sum(_inner_rows_of(b, name, where) for b in record["blocks"])
    outer = record["global_shape"][0]
    lo, hi = Fraction(rows[0] * total, outer), Fraction(rows[1] * total, outer)
    if lo.denominator != 1 or hi.denominator != 1:
        group = Fraction(outer, total)
        raise StateMismatchError(
            f"{where}: rows [{rows[0]}, {rows[1]}) do not fall on the groups of {record['subclass']['class']} (its inner "
            f"tensor {name!r} has one row per {group} outer rows); shard it so that every rank's rows start and end on "
            "a group boundary, restore on the mesh it was saved from, or load it with checkpointd.load(..., dequantize=True)")
    return int(lo), int(hi)


def _inner_rows_of(block: dict[str, Any], name: str, where: str) -> int:
    """Dim 0 of a block's inner tensor ``name``, from the manifest."""
    shape = (block.get("inner_shapes") or {}).get(name)
    if not isinstance(shape, list) or not shape or not isinstance(shape[0], int):
        raise StateMismatchError(f"{where}: rank {block.get('rank')}'s block records no rows for inner tensor {name!r} "
                                 f"(shape {shape}); a 'rows' rule needs an inner tensor of at least one dimension")
    return shape[0]


__all__ = ["CtxForShape", "InnerSharding", "REPLICATED", "ROWS", "RULES", "RowBlock", "inner_rows", "no_rule",
           "register_inner_sharding", "row_blocks", "rule_for"]
