"""torchao's low-bit optimizers (AdamW8bit, AdamW4bit, AdamWFp8) under FSDP2 in sharded mode, gloo on CPU:
each rank's moments are a DTensor whose local tensor is the optimizer state subclass (``OptimState8bit``,
``OptimState4bit``, ``OptimStateFp8``), resharded by their built-in inner-sharding rules.

- saved on 4 ranks, restored on 2: every moment's inner tensors (codes, block scales, qmap) equal the ones
  gathered before the save, bit for bit, in the live storages; the next optimizer step gives the same state
  and parameters as the 4-rank run's next step;
- ``checkpointd.load`` (4 -> 1, 2 -> 1) assembles each global optimizer state equal to the gathered one, and a
  single-process AdamW*bit fed that state takes the same next step as the 2-rank run;
- a target whose rows cut a quantization block is refused, and so is a whole load of a class without a rule
  (``dequantize=True`` still gives plain values).

The weight is 256x64: torchao quantizes a local state of at least 4096 values in whole blocks, so each rank
of 4 (64 rows) holds quantized state; a block is 4 rows (8-bit, fp8: 256 values) or 2 rows (4-bit: 128
values, two codes a byte). The optimizers run eagerly (``torch.compiler.set_stance("force_eager")``):
compiling their step on the CPU takes longer than this module's whole budget, and their state layout is
the same either way. Gradients are set from seeded global tensors (each rank its rows), so every run
takes the same steps whatever its world size.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

from dist_harness import run_distributed, world_mesh

import checkpointd
from checkpointd import CheckpointManager, DistributedOptions, StagingOptions, StateMismatchError, commit
from checkpointd.format import subclass_sharding
from checkpointd.restore.assemble import sharded_values
from checkpointd.restore.step import read_step
from checkpointd.storage.store import Store

torchao_optim = pytest.importorskip("torchao.optim")

warnings.filterwarnings("ignore", message=".*KernelPreference.*")
OPTS = dict(mode="sharded", compression=None, keep_last=None, staging=StagingOptions(freeze_gc=False),
            distributed=DistributedOptions(timeout_secs=30))
OPTIMIZERS = {"8bit": "AdamW8bit", "4bit": "AdamW4bit", "fp8": "AdamWFp8"}
CLASSES = {"8bit": "OptimState8bit", "4bit": "OptimState4bit", "fp8": "OptimStateFp8"}
SHAPE = (256, 64)
MOMENTS = ("exp_avg", "exp_avg_sq")


def _models(world: int, seed: int) -> dict[str, Any]:
    """One 256x64 linear layer and its optimizer per low-bit AdamW; under FSDP2 when ``world`` > 0."""
    from torch.distributed.fsdp import fully_shard

    out: dict[str, Any] = {}
    for tag, name in OPTIMIZERS.items():
        torch.manual_seed(seed)
        model = nn.Linear(SHAPE[1], SHAPE[0])
        if world:
            fully_shard(model, mesh=world_mesh())
        out[f"model{tag}"] = model
        out[f"opt{tag}"] = getattr(torchao_optim, name)(model.parameters(), lr=1e-2)
    return out


def _step(state: dict[str, Any], seed: int, rank: int = 0, world: int = 0) -> None:
    """One step of every optimizer on gradients drawn from ``seed`` (the global gradient; a DTensor
    parameter gets its rows)."""
    from torch.distributed.tensor import DTensor

    for tag in OPTIMIZERS:
        g = torch.Generator().manual_seed(seed)
        model = state[f"model{tag}"]
        for p in model.parameters():
            grad = torch.randn(tuple(p.shape), generator=g)
            if isinstance(p, DTensor):
                grad = DTensor.from_local(torch.chunk(grad, world)[rank].clone(), p.device_mesh, p.placements,
                                          run_check=False, shape=p.shape, stride=p.stride())
            p.grad = grad
        with torch.compiler.set_stance("force_eager"):
            state[f"opt{tag}"].step()
        state[f"opt{tag}"].zero_grad()


def _local(t: Any) -> Any:
    return getattr(t, "_local_tensor", t)


def _inner(t: Any) -> dict[str, torch.Tensor]:
    """A state subclass's inner tensors (plain: ``{"": t}``), cloned."""
    if type(t) is torch.Tensor:
        return {"": t.detach().clone()}
    return {n: getattr(t, n).detach().clone() for n in t.__tensor_flatten__()[0]}


def _snapshot(state: dict[str, Any], world: int) -> dict[str, Any]:
    """Global parameters and every moment's global inner tensors (collective when ``world`` > 0): the
    ranks' local inner tensors, ``"rows"`` ones concatenated in rank order, ``qmap`` from rank 0."""
    import torch.distributed as dist

    out: dict[str, Any] = {}
    for tag in OPTIMIZERS:
        model, opt = state[f"model{tag}"], state[f"opt{tag}"]
        for fqn, p in model.named_parameters():
            out[f"{tag}/{fqn}"] = (p.full_tensor() if world else p).detach().clone()
            for m in MOMENTS:
                local = _local(opt.state[p][m])
                mine = {"class": type(local).__name__, "inner": _inner(local)}
                parts = [mine]
                if world:  # float8 travels as its bytes (all_gather_object cannot unpickle float8 storages)
                    parts = [None] * world
                    dist.all_gather_object(parts, {**mine, "inner": {n: _bytes(v) for n, v in mine["inner"].items()}})
                    parts = [{**q, "inner": {n: _from_bytes(v, mine["inner"][n]) for n, v in q["inner"].items()}} for q in parts]
                inner = {n: (v if n == "qmap" else torch.cat([q["inner"][n] for q in parts])) for n, v in parts[0]["inner"].items()}
                out[f"{tag}/{fqn}/{m}"] = {"class": parts[0]["class"], "inner": inner}
    return out


def _assert_snapshot(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    assert sorted(got) == sorted(want), what
    for k, w in want.items():
        g = got[k]
        if isinstance(w, torch.Tensor):
            assert torch.equal(g, w), (what, k)
            continue
        assert g["class"] == w["class"] and sorted(g["inner"]) == sorted(w["inner"]), (what, k)
        for n, t in w["inner"].items():
            assert g["inner"][n].dtype == t.dtype and torch.equal(_bytes(g["inner"][n]), _bytes(t)), (what, k, n)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """Bytes of ``t`` (``torch.equal`` has no float8 kernel on the CPU)."""
    return t.reshape(-1).contiguous().view(torch.uint8)


def _from_bytes(data: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Another rank's inner tensor from its :func:`_bytes`; ``like`` (this rank's) gives dtype and trailing dims."""
    return data.view(like.dtype).reshape(-1, *like.shape[1:])


def save_on_4(rank: int, world: int, root: str) -> None:
    warnings.filterwarnings("ignore")
    state = _models(world, 0)
    _step(state, 1, rank, world)
    _step(state, 2, rank, world)
    _save_with_reference(state, Path(root), "r4", 2, rank, world)


def _save_with_reference(state: dict[str, Any], root: Path, name: str, step: int, rank: int, world: int) -> None:
    """Save ``step`` under ``root/name``, then keep the state it saved and the one a step later (``want<name>.pt``)."""
    with CheckpointManager(root / name, state, **OPTS) as mgr:
        mgr.save(step)
    saved = _snapshot(state, world)
    _step(state, step + 1, rank, world)
    after = _snapshot(state, world)
    if rank == 0:
        torch.save({"saved": saved, "after": after}, root / f"want{name[1:]}.pt")


def restore_on_2(rank: int, world: int, root: str, save_as: str | None = "r2") -> dict[str, Any]:
    """Restore ``r4`` on ``world`` ranks, in place, check it and the next step; then save it as ``save_as``."""
    warnings.filterwarnings("ignore")
    want = torch.load(Path(root) / "want4.pt", weights_only=True)
    state = _models(world, 1)
    _step(state, 7, rank, world)  # optimizer state to restore into
    live = {(tag, fqn, m): _local(state[f"opt{tag}"].state[p][m]) for tag in OPTIMIZERS
            for fqn, p in state[f"model{tag}"].named_parameters() for m in MOMENTS}
    ptrs = {k: [v.data_ptr() for v in _inner_views(t)] for k, t in live.items()}
    with CheckpointManager(Path(root) / "r4", state, **OPTS) as mgr:
        restored = mgr.restore_latest()
    for k, t in live.items():  # in place: the live objects and their storages stay
        tag, fqn, m = k
        p = dict(state[f"model{tag}"].named_parameters())[fqn]
        assert _local(state[f"opt{tag}"].state[p][m]) is t and [v.data_ptr() for v in _inner_views(t)] == ptrs[k], k
    _assert_snapshot(_snapshot(state, world), want["saved"], f"4 -> {world}")
    _step(state, 3, rank, world)
    _assert_snapshot(_snapshot(state, world), want["after"], f"the step after 4 -> {world}")
    if save_as is not None:
        _save_with_reference(state, Path(root), save_as, 3, rank, world)
    return {"restored": restored, "classes": sorted({type(t).__name__ for t in live.values()})}


def _inner_views(t: Any) -> list[torch.Tensor]:
    return [t] if type(t) is torch.Tensor else [getattr(t, n) for n in t.__tensor_flatten__()[0]]


@pytest.fixture(scope="module")
def steps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``r4``: the three optimizers saved on 4 ranks at step 2; ``r2``: restored on 2 (asserted there),
    stepped and saved at step 3; ``want4.pt``/``want2.pt``: the states gathered at each save and after the
    next step."""
    root = tmp_path_factory.mktemp("low-bit-optim")
    run_distributed(save_on_4, 4, str(root), deadline_secs=120)
    results = run_distributed(restore_on_2, 2, str(root), deadline_secs=120)
    assert results == [{"restored": 2, "classes": sorted(CLASSES.values()) + ["Tensor"]}] * 2
    return root


def _want(root: Path, name: str) -> dict[str, Any]:
    return torch.load(root / name, weights_only=True)


def _loaded_snapshot(loaded: dict[str, Any]) -> dict[str, Any]:
    """:func:`_snapshot` of what ``checkpointd.load`` gives (FQN-keyed optimizer state)."""
    out: dict[str, Any] = {}
    for tag in OPTIMIZERS:
        for fqn, p in loaded[f"model{tag}"].items():
            out[f"{tag}/{fqn}"] = p
            for m in MOMENTS:
                t = loaded[f"opt{tag}"]["state"][fqn][m]
                assert tuple(t.shape) == tuple(p.shape), (tag, fqn, m)
                out[f"{tag}/{fqn}/{m}"] = {"class": type(t).__name__, "inner": _inner(t)}
    return out


def test_reshard_4_to_2_restores_in_place_and_steps_alike(steps: Path) -> None:
    """Asserted on both ranks by the fixture's runs; here, what the manifest records of the 4-rank blocks."""
    records = commit.read_committed_manifest(Store(steps / "r4"), "step-000000002").extra["sharded"]["tensors"]
    for tag, cls in CLASSES.items():
        rec = records[f"opt{tag}"]['["state", "weight", "exp_avg"]']
        assert rec["subclass"]["class"] == f"torchao.optim.subclass_{tag}.{cls}"
        assert [b["shape"] for b in rec["blocks"]] == [[64, 64]] * 4
        per_block = 256 if tag != "4bit" else 128
        assert [b["inner_shapes"]["scale"] for b in rec["blocks"]] == [[64 * 64 // per_block]] * 4


def test_one_rank_restores_the_4_rank_states_in_place_and_steps_alike(steps: Path) -> None:
    """A world of one (FSDP2 on a 1-rank gloo group): each moment's blocks of the 4 ranks become one local
    state, in the live storages, and the next step matches the 4-rank run's."""
    results = run_distributed(restore_on_2, 1, str(steps), None, deadline_secs=120)
    assert results == [{"restored": 2, "classes": sorted(CLASSES.values()) + ["Tensor"]}]


def test_load_assembles_the_global_states_and_one_process_steps_alike(steps: Path) -> None:
    _assert_snapshot(_loaded_snapshot(checkpointd.load(steps / "r4")), _want(steps, "want4.pt")["saved"], "4 -> 1")
    loaded = checkpointd.load(steps / "r2")
    _assert_snapshot(_loaded_snapshot(loaded), _want(steps, "want2.pt")["saved"], "2 -> 1")
    for tag in OPTIMIZERS:
        assert type(loaded[f"opt{tag}"]["state"]["weight"]["exp_avg"]).__name__ == CLASSES[tag]
        assert type(loaded[f"opt{tag}"]["state"]["bias"]["exp_avg"]) is torch.Tensor  # 256 values: not quantized
    # one process, no FSDP2: the assembled state in the optimizer, then the next step of the 2-rank run
    state = _models(0, 2)
    for tag in OPTIMIZERS:
        model, opt = state[f"model{tag}"], state[f"opt{tag}"]
        model.load_state_dict(loaded[f"model{tag}"])
        saved = loaded[f"opt{tag}"]
        index = {fqn: i for i, (fqn, _) in enumerate(model.named_parameters())}
        opt.load_state_dict({"state": {index[k]: v for k, v in saved["state"].items()},
                             "param_groups": [{**g, "params": [index[k] for k in g["params"]]} for g in saved["param_groups"]]})
    _step(state, 4)
    _assert_snapshot(_snapshot(state, 0), _want(steps, "want2.pt")["after"], "the step after 2 -> 1")


def test_a_target_cutting_a_quantization_block_is_refused(steps: Path) -> None:
    """FSDP2 never makes such a shard here (torchao quantizes a shard in whole blocks only): the leaf is asked
    directly for rows that start inside a block, then for rows on block boundaries."""
    from torchao.optim.subclass_4bit import OptimState4bit
    from torchao.optim.subclass_8bit import OptimState8bit

    store = Store(steps / "r2")
    manifest = commit.read_committed_manifest(store, "step-000000003")
    values = sharded_values(manifest, read_step(store, "step-000000003", manifest, rank=None))
    want = _want(steps, "want2.pt")["saved"]
    for tag, cls, rows_a_block in (("8bit", OptimState8bit, 4), ("4bit", OptimState4bit, 2)):
        leaf = values[f"opt{tag}"]["state"]["weight"]["exp_avg"]
        live = cls.zeros((64, 64), signed=True, block_size=64 * rows_a_block)
        start = rows_a_block // 2
        with pytest.raises(StateMismatchError, match=rf"rows \[{start}, {start + 64}\) do not fall on the groups of "
                           rf".*{cls.__name__} \(its inner tensor 'scale' has one row per"):
            leaf.pairs_for(live, (start, 0), (64, 64), "exp_avg")
        pairs = dict(zip(live.__tensor_flatten__()[0], (src for _, src in leaf.pairs_for(live, (128, 0), (64, 64), "exp_avg"))))
        inner = want[f"{tag}/weight/exp_avg"]["inner"]
        codes_a_row = 1 if tag == "8bit" else 64 // 2  # 8-bit codes keep the outer shape; 4-bit: 2 codes a byte, flat
        assert torch.equal(pairs["codes"], inner["codes"][128 * codes_a_row:192 * codes_a_row])
        assert torch.equal(pairs["scale"], inner["scale"][128 // rows_a_block:192 // rows_a_block])
        assert torch.equal(pairs["qmap"], inner["qmap"])


def test_a_whole_load_of_a_class_without_a_rule_is_refused(steps: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(subclass_sharding.RULES, "torchao.optim.subclass_8bit.OptimState8bit")
    with pytest.raises(StateMismatchError, match=r"saved on mesh \(2,\) with a torchao.optim.subclass_8bit.OptimState8bit "
                       r"local tensor; resharding it .*register_inner_sharding"):
        checkpointd.load(steps / "r2")
    with pytest.warns(UserWarning, match="not bit-exact"):
        plain = checkpointd.load(steps / "r2", dequantize=True)
    moment = plain["opt8bit"]["state"]["weight"]["exp_avg"]
    assert type(moment) is torch.Tensor and tuple(moment.shape) == SHAPE
