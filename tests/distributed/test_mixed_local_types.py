"""A DTensor whose ranks hold different local types, under FSDP2 on gloo.

torchao's AdamW8bit quantizes a moment only from 4096 values, in whole blocks of 256. A 127x64 weight on
2 ranks is cut into 64 and 63 rows: rank 0's moments are ``OptimState8bit`` (4096 values), rank 1's plain
tensors (4032). The manifest names the class and marks rank 1's blocks plain:

- restored on the same 2 ranks, each rank gets its own blocks back in place, bit for bit;
- on 1 rank, or whole with ``checkpointd.load``, the blocks cannot be put together: refused, naming the
  ranks and what to do; ``load(..., dequantize=True)`` assembles the dequantized values.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

from dist_harness import run_distributed, world_mesh

import checkpointd
from checkpointd import CheckpointManager, DistributedOptions, StagingOptions, StateMismatchError

torchao_optim = pytest.importorskip("torchao.optim")

SHAPE = (127, 64)
OPTS = dict(mode="sharded", compression=None, keep_last=None, staging=StagingOptions(freeze_gc=False),
            distributed=DistributedOptions(timeout_secs=30))
MOMENTS = ("exp_avg", "exp_avg_sq")


def _build(world: int, seed: int) -> tuple[nn.Module, Any]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Linear(SHAPE[1], SHAPE[0], bias=False)
    fully_shard(model, mesh=world_mesh())
    return model, torchao_optim.AdamW8bit(model.parameters(), lr=1e-2)


def _step(model: nn.Module, opt: Any, seed: int, rank: int, world: int) -> None:
    """One step on a seeded global gradient (each rank its rows)."""
    from torch.distributed.tensor import DTensor

    p = model.weight
    grad = torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))
    p.grad = DTensor.from_local(torch.chunk(grad, world)[rank].clone(), p.device_mesh, p.placements, run_check=False,
                                shape=p.shape, stride=p.stride())
    with torch.compiler.set_stance("force_eager"):
        opt.step()
    opt.zero_grad()


def _locals(model: nn.Module, opt: Any) -> dict[str, Any]:
    return {m: opt.state[model.weight][m]._local_tensor for m in MOMENTS}


def _inner_bytes(t: torch.Tensor) -> dict[str, torch.Tensor]:
    names = t.__tensor_flatten__()[0] if type(t) is not torch.Tensor else [""]
    return {n: (getattr(t, n) if n else t).detach().reshape(-1).contiguous().view(torch.uint8).clone() for n in names}


def save_and_restore_on_2(rank: int, world: int, root: str) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    model, opt = _build(world, 0)
    _step(model, opt, 1, rank, world)
    saved = {m: _inner_bytes(t) for m, t in _locals(model, opt).items()}
    dequantized = {m: (t.dequantize() if type(t) is not torch.Tensor else t).clone() for m, t in _locals(model, opt).items()}
    with CheckpointManager(root, {"model": model, "optim": opt}, **OPTS) as mgr:
        mgr.save(1)
    _step(model, opt, 2, rank, world)  # the live state moves on
    live = _locals(model, opt)
    ptrs = {m: [v.data_ptr() for v in ([t] if type(t) is torch.Tensor else [getattr(t, n) for n in t.__tensor_flatten__()[0]])]
            for m, t in live.items()}
    with CheckpointManager(root, {"model": model, "optim": opt}, **OPTS) as mgr:
        restored = mgr.restore_latest()
    after = _locals(model, opt)
    return {"classes": sorted({type(t).__name__ for t in live.values()}), "restored": restored,
            "in_place": all(after[m] is live[m] for m in MOMENTS) and ptrs == {
                m: [v.data_ptr() for v in ([t] if type(t) is torch.Tensor else [getattr(t, n) for n in t.__tensor_flatten__()[0]])]
                for m, t in after.items()},
            "equal": all(torch.equal(a, b) for m in MOMENTS for a, b in zip(_inner_bytes(after[m]).values(), saved[m].values())),
            "dequantized": dequantized}


def restore_on_1(rank: int, world: int, root: str) -> str | None:
    warnings.filterwarnings("ignore")
    model, opt = _build(world, 3)
    _step(model, opt, 5, rank, world)
    before = {m: _inner_bytes(t) for m, t in _locals(model, opt).items()}
    try:
        with CheckpointManager(root, {"model": model, "optim": opt}, **OPTS) as mgr:
            mgr.restore_latest()
    except StateMismatchError as exc:
        unchanged = all(torch.equal(a, b) for m in MOMENTS
                        for a, b in zip(_inner_bytes(_locals(model, opt)[m]).values(), before[m].values()))
        return str(exc) if unchanged else "changed"
    return None


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("mixed")
    return root, run_distributed(save_and_restore_on_2, 2, str(root), deadline_secs=120)


def test_the_manifest_marks_the_blocks_stored_plain(saved: tuple[Path, list[dict[str, Any]]]) -> None:
    root, results = saved
    assert [r["classes"] for r in results] == [["OptimState8bit"], ["Tensor"]]
    manifest = json.loads((root / "step-000000001" / "manifest.json").read_text())
    for m in MOMENTS:
        rec = manifest["extra"]["sharded"]["tensors"]["optim"][json.dumps(["state", "weight", m])]
        assert rec["subclass"]["class"] == "torchao.optim.subclass_8bit.OptimState8bit"
        assert [(b["rank"], b["shape"], b.get("plain", False)) for b in rec["blocks"]] == [(0, [64, 64], False),
                                                                                          (1, [63, 64], True)]


def test_the_same_ranks_restore_their_own_blocks_in_place(saved: tuple[Path, list[dict[str, Any]]]) -> None:
    _, results = saved
    for r in results:
        assert r["restored"] == 1 and r["in_place"] and r["equal"], r


def test_other_world_sizes_and_whole_loads_are_refused_and_dequantize_assembles(
        saved: tuple[Path, list[dict[str, Any]]]) -> None:
    root, results = saved
    [refusal] = run_distributed(restore_on_1, 1, str(root), deadline_secs=120)
    assert refusal is not None and refusal != "changed", "a 1-rank restore of mixed blocks was not refused cleanly"
    assert "different local types" in refusal and "ranks [1]" in refusal and "dequantize=True" in refusal
    with pytest.raises(StateMismatchError, match=r"different local types .*ranks \[1\].*dequantize=True"):
        checkpointd.load(root)
    loaded = checkpointd.load(root, dequantize=True)
    for m in MOMENTS:
        want = torch.cat([results[0]["dequantized"][m], results[1]["dequantized"][m]])
        assert torch.equal(loaded["optim"]["state"]["weight"][m], want), m
