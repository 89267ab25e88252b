"""Sharded checkpoints read back: per-rank files -> {state name: tree} with resharding-capable leaves.

Layout of a sharded step (``mode="sharded"``), recorded in ``manifest.extra["sharded"]``::

    step-000000100/
        shards/rank-00000.pt[.zst]   {"entries": {name: skeleton}, "blocks": {name: {path: local tensor}},
                                      "checkpointd_rng": rank 0's RNG, "epoch": step}
        shards/rank-00001.pt[.zst]   {"blocks": {...}, "checkpointd_rng": rank 1's RNG, "epoch": step}
        manifest.json                files (FileEntry.rank = writer), entries -> rank 0's file, and
                                     extra["sharded"] = {"layout_version": 1,
                                                         "rank_files": {"0": "shards/rank-00000.pt", ...},
                                                         "tensors": {name: {path: {"global_shape", "dtype",
                                                             "placements", "mesh_shape", "mesh_dim_names",
                                                             "dim_order", "subclass"?, "blocks": [{"rank", "offsets",
                                                             "shape", "inner_shapes"?, "ctx"?}]}}}}
        COMMITTED

``path`` is the JSON list of keys leading to the tensor inside the entry's tree (e.g.
``["state", "0.weight", "exp_avg"]``); the skeleton holds None there.
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping

from checkpointd.errors import CorruptCheckpointError
from checkpointd.format.dequantize import not_exact_warning
from checkpointd.format.manifest import Manifest
from checkpointd.format.sharding import map_tree, materialize, path_key
from checkpointd.restore.sharded_subclasses import dequantize_leaves, leaf_for

SHARD_DIR = "shards"


def shard_file_name(rank: int, codec_suffix: str = "") -> str:
    return f"{SHARD_DIR}/rank-{rank:05d}.pt{codec_suffix}"


def sharded_values(manifest: Manifest, contents: Mapping[str, Any]) -> dict[str, Any]:
    """``{state name: tree}`` where every sharded tensor is a :class:`ShardedLeaf` reading ``contents`` on demand.

    Args:
        contents: decoded rank files by relative path; only the files of ranks whose blocks are asked for
            need to be present (rank 0's always).
    """
    info = manifest.extra.get("sharded")
    if not isinstance(info, dict) or "rank_files" not in info:
        raise CorruptCheckpointError(f"step {manifest.step}: sharded manifest without extra['sharded'] layout")
    rank_files = {int(r): p for r, p in info["rank_files"].items()}
    root = contents.get(rank_files.get(0, ""))
    if not isinstance(root, dict) or "entries" not in root:
        raise CorruptCheckpointError(f"step {manifest.step}: rank 0's shard file was not read or has no entries")

    def reader(name: str) -> Any:
        def read(rank: int) -> dict[str, Any]:
            content = contents.get(rank_files.get(rank, ""))
            if not isinstance(content, dict):
                raise CorruptCheckpointError(f"step {manifest.step}: the shard file of rank {rank} was not read")
            return content.get("blocks", {}).get(name, {})

        return read

    out: dict[str, Any] = {}
    tensors = info.get("tensors", {})
    for name in manifest.entries:
        if name not in root["entries"]:
            raise CorruptCheckpointError(f"step {manifest.step}: rank 0's shard file has no entry {name!r}")
        records = tensors.get(name, {})
        read = reader(name)

        def leaf(path: tuple[Any, ...], x: Any, records: dict[str, Any] = records, read: Any = read, name: str = name) -> Any:
            rec = records.get(path_key(path))
            return leaf_for(name, path_key(path), rec, read) if rec is not None else x

        out[name] = map_tree(root["entries"][name], leaf)
    return out


def assemble_full_values(manifest: Manifest, contents: Mapping[str, Any], dequantize: bool = False) -> dict[str, Any]:
    """``{state name: value}`` of a sharded checkpoint with every tensor whole (for ``checkpointd.load``).

    Model entries are FQN-keyed state dicts; optimizer entries are FQN-keyed (as PhysicsNeMo writes them
    under FSDP) when their module was registered beside them. A DTensor whose blocks are tensor
    subclasses comes back as the global subclass (:mod:`checkpointd.restore.sharded_subclasses`), or,
    with ``dequantize``, as the plain tensor its blocks dequantize to (not bit-exact; warned).
    """
    values = sharded_values(manifest, contents)
    done: dict[str, str] = {}
    if dequantize:
        dequantize_leaves(values, done)
    out = {name: materialize(tree) for name, tree in values.items()}
    if done:
        warnings.warn(not_exact_warning(done, f"assembling step {manifest.step}'s sharded values"), UserWarning,
                      stacklevel=3)
    return out
