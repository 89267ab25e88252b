"""DTensor local shards <-> (global shape, offsets, placements, mesh) records, and resharding on restore.

Saving (every rank, on the training thread): :func:`split_tree` walks one entry's state tree and
replaces each DTensor by its local tensor (what the snapshot stage copies) and a JSON record of where
that block sits in the global tensor. A rank writes a block only if it is the first holder along
every ``Replicate`` mesh dimension, so replicated data is written once. Plain tensors are written by
rank 0 only (they are the same on every rank: DDP weights, optimizer step counters).

Restoring (any world size or mesh): a stored tensor is a :class:`ShardedLeaf`, which can produce any
rectangular region of the global tensor from the blocks that overlap it (reading only the rank files
that hold them). A live DTensor asks for exactly its local region
(``compute_local_shape_and_global_offset``), so uneven shards, 2-D meshes and a different mesh shape
all reduce to the same block intersection. Copies go *into* the live local tensors, which keeps their
strides (channels_last) and device.

A local tensor that is a tensor subclass (FSDP2 over torchao's NF4 or float8 all-gather weights) is
stored as that subclass, through its inner tensors; its record adds ``"subclass"`` (class, inner
tensor dtypes) and each block its ``"inner_shapes"`` and a description of its flatten ``"ctx"``.
Restoring it (:mod:`checkpointd.restore.sharded_subclasses`) needs the same blocks, or the class's
inner-sharding rule (:mod:`checkpointd.format.subclass_sharding`).

Limits: ``Partial`` placements and FSDP2+TP strided shards (``_StridedShard``) are refused with a
StateError at save time.
"""

from __future__ import annotations

import json
import math
from typing import Any, Callable, Iterator, cast

import torch

from checkpointd.errors import CorruptCheckpointError, StateError, StateMismatchError
from checkpointd.format.subclasses import is_stored_subclass, local_description

PathKey = str
"""JSON list of the keys leading to a leaf inside one entry's tree, e.g. ``["state", "0.weight", "exp_avg"]``."""


def is_dtensor(x: Any) -> bool:
    return type(x).__name__ == "DTensor" and hasattr(x, "device_mesh") and hasattr(x, "placements")


def placement_name(p: Any) -> str:
    """``S(d)`` for Shard(d), ``R`` for Replicate; anything else is refused."""
    kind = type(p).__name__
    if kind == "Shard":
        return f"S({p.dim})"
    if kind == "Replicate":
        return "R"
    raise StateError(
        f"checkpointd cannot save a DTensor with placement {p!r}: only Shard and Replicate are supported; "
        "redistribute Partial tensors (e.g. .redistribute(placements=[Replicate()])) before saving"
    )


def local_region(dt: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global offsets, local shape) of this rank's block of a DTensor (uneven shards included)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offsets = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, dt.placements)
    return tuple(int(o) for o in offsets), tuple(int(s) for s in shape)


def owns_block(dt: Any) -> bool:
    """True if this rank is the first holder of its block along every Replicate mesh dimension."""
    coord = dt.device_mesh.get_coordinate()
    if coord is None:
        return False
    return all(c == 0 for c, p in zip(coord, dt.placements) if type(p).__name__ == "Replicate")


def dim_order(t: torch.Tensor) -> list[int]:
    """Dimensions from outermost to innermost in memory (channels_last 4-D: [0, 2, 3, 1])."""
    strides = t.stride()
    return sorted(range(t.dim()), key=lambda d: (-strides[d], d))


def walk(tree: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """(path, leaf) for every leaf of a tree of dicts/lists/tuples."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from walk(v, path + (k,))
    elif isinstance(tree, (list, tuple)) and not isinstance(tree, torch.Size):
        for i, v in enumerate(tree):
            yield from walk(v, path + (i,))
    else:
        yield path, tree


def map_tree(tree: Any, fn: Callable[[tuple[Any, ...], Any], Any], path: tuple[Any, ...] = ()) -> Any:
    """Rebuild ``tree`` (same container types) with each leaf replaced by ``fn(path, leaf)``."""
    if isinstance(tree, dict):
        return type(tree)((k, map_tree(v, fn, path + (k,))) for k, v in tree.items())
    if isinstance(tree, list):
        return [map_tree(v, fn, path + (i,)) for i, v in enumerate(tree)]
    if isinstance(tree, tuple) and not isinstance(tree, torch.Size):
        return tuple(map_tree(v, fn, path + (i,)) for i, v in enumerate(tree))
    return fn(path, tree)


def path_key(path: tuple[Any, ...]) -> PathKey:
    return json.dumps(list(path))


def split_tree(tree: Any, rank: int, cache: dict[tuple[Any, ...], "_SplitLeaf"] | None = None) -> tuple[Any, dict[PathKey, torch.Tensor], dict[PathKey, dict[str, Any]]]:
    """Split one entry's state tree into (skeleton, local blocks, block records) for this rank.

    The skeleton keeps every non-DTensor leaf on rank 0 (None for tensors elsewhere) and None where a
    DTensor was; ``blocks`` maps the DTensor's path to this rank's local tensor (only if it owns the
    block); ``records`` describe every DTensor (global shape, placements, mesh, this rank's block).

    ``cache`` (kept by the caller between saves, replaced in place with this tree's leaves): a DTensor
    leaf that is the same object, with the same spec, whose local tensor views the same memory with the
    same shape and strides as at the same path last time reuses last time's record; computing it (local
    region, placements, mesh coordinate) dominates this function for trees of a few hundred tensors.
    (FSDP2 may hand out a new local tensor object over the same memory after each step: identity of the
    local tensor is not required, its layout is.)
    """
    blocks: dict[PathKey, torch.Tensor] = {}
    records: dict[PathKey, dict[str, Any]] = {}
    fresh: dict[tuple[Any, ...], _SplitLeaf] = {}

    def leaf(path: tuple[Any, ...], x: Any) -> Any:
        if is_dtensor(x):
            held = getattr(x, "_local_tensor", None)  # a subclass: the object itself (to_local() may give a view)
            local = held if is_stored_subclass(held) else x.to_local()
            hit = cache.get(path) if cache is not None else None
            if hit is None or not hit.matches(x, local):
                hit = _SplitLeaf(path, x, local, rank)
            fresh[path] = hit
            if hit.owned:
                blocks[hit.key] = local
            block = hit.record["block"]
            records[hit.key] = {**hit.record, "block": dict(block) if block is not None else None}
            return None
        if isinstance(x, torch.Tensor) and rank != 0:
            return None
        return x

    with torch.no_grad():  # to_local() without autograd: the local tensor itself
        skeleton = map_tree(tree, leaf)
    if cache is not None:
        cache.clear()
        cache.update(fresh)
    return skeleton, blocks, records


class _SplitLeaf:
    """One DTensor leaf's path key and record, with what must stay the same for them to be reused."""

    __slots__ = ("dt", "spec", "layout", "key", "record", "owned", "ctx")

    def __init__(self, path: tuple[Any, ...], x: Any, local: torch.Tensor, rank: int) -> None:
        self.dt, self.spec = x, getattr(x, "_spec", None)
        self.layout, self.ctx = _layout_and_ctx(local)
        self.key = path_key(path)
        offsets, shape = local_region(x)
        mesh = x.device_mesh
        self.record: dict[str, Any] = {
            "global_shape": list(x.shape),
            "dtype": str(x.dtype).removeprefix("torch."),
            "placements": [placement_name(p) for p in x.placements],
            "mesh_shape": list(mesh.shape),
            "mesh_dim_names": list(mesh.mesh_dim_names) if mesh.mesh_dim_names else None,
            "dim_order": dim_order(local) if local.dim() else [],
            "block": None,
        }
        self.owned = owns_block(x) and math.prod(shape) > 0
        if self.owned:
            self.record["block"] = {"rank": rank, "offsets": list(offsets), "shape": list(shape)}
        if is_stored_subclass(local):
            if tuple(local.shape) != tuple(shape):
                raise StateError(f"a DTensor at {self.key} has a padded {type(local).__name__} local tensor "
                                 f"({tuple(local.shape)} for a block of {tuple(shape)}), which checkpointd cannot store")
            part, block_part = local_description(local)
            self.record["subclass"] = part
            if self.owned:
                self.record["block"].update(block_part)

    def matches(self, x: Any, local: torch.Tensor) -> bool:
        if not (x is self.dt and self.spec is not None and getattr(x, "_spec", None) is self.spec):
            return False
        layout, ctx = _layout_and_ctx(local)
        return layout == self.layout and (self.ctx is None or _same(ctx, self.ctx))


def _layout_and_ctx(t: torch.Tensor) -> tuple[tuple[Any, ...], Any]:
    """What the cached record depends on: the memory layout (a subclass has no storage of its own: its
    inner tensors' layouts) and, for a subclass, its flatten context (the record describes it; a change
    makes a new record), from one ``__tensor_flatten__`` call; the context is None for plain tensors."""
    if is_stored_subclass(t):
        names, ctx = t.__tensor_flatten__()
        inner = tuple((n, _layout_and_ctx(getattr(t, n))[0]) for n in names)
        return (type(t), tuple(t.shape), t.dtype, inner), ctx
    return (t.data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device), None


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - a context whose parts do not compare: never reuse the record
        return False


def merge_records(per_rank: list[dict[str, dict[PathKey, dict[str, Any]]]]) -> dict[str, dict[PathKey, dict[str, Any]]]:
    """Per-rank records ``{entry: {path: record}}`` -> one record per tensor with the list of all blocks.

    Ranks may hold different local types for one DTensor: torchao quantizes an optimizer state only
    from a size up, and uneven FSDP2 shards can fall on either side of it. The record then names the
    subclass, and each block stored as a plain tensor says so (``"plain": true``).
    """
    out: dict[str, dict[PathKey, dict[str, Any]]] = {}
    kinds: dict[tuple[str, PathKey], list[tuple[dict[str, Any], Any]]] = {}
    for rank_records in per_rank:
        for name, by_path in rank_records.items():
            dest = out.setdefault(name, {})
            for key, rec in by_path.items():
                merged = dest.get(key)
                if merged is None:
                    merged = {k: v for k, v in rec.items() if k != "block"}
                    merged["blocks"] = []
                    dest[key] = merged
                if rec.get("block") is not None:
                    block = dict(rec["block"])
                    merged["blocks"].append(block)
                    kinds.setdefault((name, key), []).append((block, rec.get("subclass")))
    for (name, key), blocks in kinds.items():
        parts = [part for _, part in blocks if part is not None]
        if parts and len(parts) < len(blocks):  # some blocks quantized, some plain
            out[name][key]["subclass"] = parts[0]
            for block, part in blocks:
                if part is None:
                    block["plain"] = True
    for by_path in out.values():
        for rec in by_path.values():
            rec["blocks"].sort(key=lambda b: (b["offsets"], b["rank"]))
    return out


# -- restoring ------------------------------------------------------------------------------------
class ShardedLeaf:
    """A stored tensor made of blocks spread over rank files; produces any region of it on demand."""

    def __init__(self, name: str, key: PathKey, record: dict[str, Any], read_blocks: Callable[[int], dict[str, Any]]) -> None:
        self.name = name
        self.key = key
        self.record = record
        self._read_blocks = read_blocks
        self.shape = tuple(record["global_shape"])
        self.dtype = getattr(torch, record["dtype"])

    def blocks_for(self, offsets: tuple[int, ...], shape: tuple[int, ...]) -> list[dict[str, Any]]:
        """The stored blocks overlapping ``[offsets, offsets + shape)``, from the manifest alone (nothing is read).

        Raises CorruptCheckpointError when they do not cover the region (the checkpoint is incomplete).
        """
        found: list[dict[str, Any]] = []
        covered = 0
        for block in self.record["blocks"]:
            lo = [max(o, b) for o, b in zip(offsets, block["offsets"])]
            hi = [min(o + s, b + bs) for o, s, b, bs in zip(offsets, shape, block["offsets"], block["shape"])]
            if any(h <= l for l, h in zip(lo, hi)) and len(shape) > 0:
                continue
            found.append(block)
            covered += math.prod(h - l for l, h in zip(lo, hi))
        if covered != math.prod(shape):
            raise CorruptCheckpointError(
                f"entry {self.name!r} tensor {self.key}: the stored blocks cover {covered} of the {math.prod(shape)} "
                "elements asked for; the checkpoint is incomplete"
            )
        return found

    def block_value(self, block: dict[str, Any]) -> Any:
        """The stored value of one of :attr:`record`'s blocks, read from its rank's file."""
        src = self._read_blocks(block["rank"]).get(self.key)
        if src is None:
            raise CorruptCheckpointError(f"entry {self.name!r} tensor {self.key}: rank {block['rank']}'s file lacks its block")
        return src

    def region(self, offsets: tuple[int, ...], shape: tuple[int, ...], out: torch.Tensor | None = None) -> torch.Tensor:
        """The values of ``[offsets, offsets + shape)`` of the global tensor (copied into ``out`` if given).

        Reads only the rank files whose blocks overlap the region (see :meth:`blocks_for`).
        """
        if out is None:
            out = torch.empty(shape, dtype=self.dtype)
        for block in self.blocks_for(offsets, shape):
            lo = [max(o, b) for o, b in zip(offsets, block["offsets"])]
            hi = [min(o + s, b + bs) for o, s, b, bs in zip(offsets, shape, block["offsets"], block["shape"])]
            src = self.block_value(block)
            src_sl = tuple(slice(l - b, h - b) for l, h, b in zip(lo, hi, block["offsets"]))
            dst_sl = tuple(slice(l - o, h - o) for l, h, o in zip(lo, hi, offsets))
            with torch.no_grad():
                out[dst_sl].copy_(src[src_sl])
        return out

    def plan_to(self, target: torch.Tensor, offsets: tuple[int, ...], shape: tuple[int, ...], where: str) -> Callable[[], None]:
        """A function copying the region ``[offsets, offsets + shape)`` into ``target`` (a live local tensor) in place."""
        def copy() -> None:
            src = self.region(offsets, shape)
            with torch.no_grad():
                target.copy_(src)

        return copy

    def target_region(self, live: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The region :func:`copy_into` asks of this leaf for ``live``: a DTensor's local block, else the whole tensor."""
        if is_dtensor(live) and tuple(live.shape) == self.shape:
            return local_region(live)
        return tuple(0 for _ in self.shape), self.shape

    def full(self) -> torch.Tensor:
        """The whole global tensor, in the memory format the blocks had (channels_last stays so)."""
        order = self.record.get("dim_order") or list(range(len(self.shape)))
        out = torch.empty_permuted(self.shape, order, dtype=self.dtype) if len(order) == len(self.shape) else torch.empty(self.shape, dtype=self.dtype)
        return self.region(tuple(0 for _ in self.shape), self.shape, out=out)


def materialize(tree: Any) -> Any:
    """Replace every ShardedLeaf in ``tree`` by its full tensor."""
    return map_tree(tree, lambda _p, x: x.full() if isinstance(x, ShardedLeaf) else x)


def stored_shape(value: Any) -> tuple[int, ...] | None:
    if isinstance(value, ShardedLeaf):
        return value.shape
    if isinstance(value, torch.Tensor):
        return tuple(value.shape)
    return None


def copy_into(live: torch.Tensor, stored: Any, where: str) -> None:
    """Copy a stored tensor (plain or ShardedLeaf) into a live tensor or DTensor, in place.

    A DTensor receives exactly its local block; a plain tensor the whole value. Dtype and device
    follow the live tensor, strides too (the copy goes into its existing storage).
    """
    plan_copy(live, stored, where)()


def plan_copy(live: torch.Tensor, stored: Any, where: str) -> Callable[[], None]:
    """:func:`copy_into` in two steps: checks now (a mismatch raises before anything is copied), the copy
    when the returned function is called. A tensor subclass's stored blocks are read and checked now."""
    shape = stored_shape(stored)
    if shape is None:
        raise StateMismatchError(f"{where}: the checkpoint holds a {type(stored).__name__}, the live state a tensor")
    if tuple(live.shape) != shape:
        raise StateMismatchError(f"{where}: live shape {tuple(live.shape)}, saved {shape}")
    if is_dtensor(live):
        offsets, lshape = local_region(live)
        target: torch.Tensor = cast(Any, live).to_local()  # a DTensor, checked by is_dtensor
        held = getattr(live, "_local_tensor", None)
        if is_stored_subclass(held):
            target = held  # the live object itself, whose inner tensors take the stored ones in place
        if tuple(target.shape) != lshape:  # padded local tensors: copy into the logical block only
            if is_stored_subclass(target):
                raise StateMismatchError(f"{where}: the live {type(target).__name__} local tensor is padded "
                                         f"({tuple(target.shape)} for a block of {lshape}); checkpointd cannot restore into it")
            target = target[tuple(slice(0, s) for s in lshape)]
    else:
        offsets, lshape, target = tuple(0 for _ in shape), shape, live
    if math.prod(lshape) == 0:
        return lambda: None
    if isinstance(stored, ShardedLeaf):
        return stored.plan_to(target, offsets, lshape, where)
    src = stored[tuple(slice(o, o + s) for o, s in zip(offsets, lshape))] if lshape else stored

    def copy() -> None:
        with torch.no_grad():
            target.copy_(src)

    return copy
