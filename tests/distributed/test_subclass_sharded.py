"""Sharded checkpoints of tensor subclasses under FSDP2 (gloo on CPU, torchao 0.18): QLoRA (frozen
``NF4Tensor`` bases sharded by FSDP2, trained LoRA adapters) and float8 training with the float8
all-gather (local ``WeightWithDynamicFloat8CastTensor``).

- saved on 4 ranks, restored on 2: the NF4 inner tensors are resharded by NF4's inner-sharding rule,
  each rank's block bit-exact against its rows of the NF4 tensor before FSDP2 split it; the float8
  master weights, LoRA adapters and optimizer state equal the gathered ones;
- saved and restored on 2 ranks (same mesh): every rank's local subclass (NF4, float8 weight, and a
  PairTensor without an inner-sharding rule) gets its stored inner tensors back in place (their
  storages unchanged), after they were zeroed and training moved on;
- ``checkpointd.load`` (one process: 4 -> 1, 2 -> 1) gives the global NF4 equal to the unsplit one, and a
  single-process manager restores it into an unsharded QLoRA model in place;
- refusals: a target that cuts NF4's groups, a class without an inner-sharding rule that would need
  resharding (``load``; ``dequantize=True`` or a registered rule then load it), and a class not
  accepted (before anything is unpickled).

(torchao's ``NF4Tensor.clone()`` re-quantizes: a few quantized scalers of the copy differ. The harness's
gathered state clones every tensor, so NF4 is compared with the unsplit tensor, never with a gathered copy.)
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

from dist_harness import gathered_state, run_distributed, world_mesh

import checkpointd
from checkpointd import (CheckpointManager, DistributedOptions, StagingOptions, StateMismatchError,
                         UnacceptedSubclassError, commit)
from checkpointd.format import subclass_sharding, subclasses
from checkpointd.format.dequantize import DEQUANTIZERS
from checkpointd.format.manifest import Manifest
from checkpointd.restore.assemble import sharded_values
from checkpointd.restore.step import read_step
from checkpointd.storage.store import Store

pytest.importorskip("torchao")

from subclasses.pair_tensor import PairTensor  # noqa: E402
from subclasses.quantized_models import LoRALinear  # noqa: E402
from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4  # noqa: E402

warnings.filterwarnings("ignore", message=".*KernelPreference.*")

OPTS = dict(compression=None, keep_last=None, staging=StagingOptions(freeze_gc=False),
            distributed=DistributedOptions(timeout_secs=30))
NF4 = "0.weight"
INNER = ["quantized_data", "scaler_mean", "quantization_factor", "quantized_scalers", "nf4"]


def _models(seed: int) -> dict[str, Any]:
    """QLoRA (one 256x256 NF4 base: one quantization factor per 64 rows) and float8 training, both under FSDP2."""
    from torch.distributed.fsdp import fully_shard
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    mesh = world_mesh()
    torch.manual_seed(seed)
    qlora = nn.Sequential(LoRALinear(256, 256))
    fully_shard(qlora, mesh=mesh)
    f8 = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    convert_to_float8_training(f8, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=True))
    fully_shard(f8, mesh=mesh)
    return {"qlora": qlora, "qopt": torch.optim.AdamW([p for p in qlora.parameters() if p.requires_grad], lr=0.01),
            "f8": f8, "f8opt": torch.optim.AdamW(f8.parameters(), lr=0.01)}


def _train(state: dict[str, Any], steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for model, opt, features, dtype in ((state["qlora"], state["qopt"], 256, torch.bfloat16), (state["f8"], state["f8opt"], 32, torch.float32)):
            model(torch.randn(8, features, generator=g).to(dtype)).float().square().mean().backward()
            opt.step()
            opt.zero_grad()


def _gathered(state: dict[str, Any]) -> dict[str, Any]:
    """Whole model and optimizer state (collective), the float8 weights plain, without the NF4 base (its
    gathered copy is cloned, which re-quantizes it): :func:`_assert_local_nf4` compares that one."""
    qlora = gathered_state(state["qlora"], state["qopt"])
    del qlora["model"][NF4]
    return {"qlora": qlora, "f8": gathered_state(state["f8"], state["f8opt"])}


def reference_nf4() -> Any:
    """The NF4 base of :func:`_models` (seed 0) before FSDP2 split it: what every restore must give back."""
    torch.manual_seed(0)
    return LoRALinear(256, 256).weight


def _assert_local_nf4(state: dict[str, Any], rank: int, world: int) -> None:
    """This rank's local NF4 equals its rows of :func:`reference_nf4`, inner tensor by inner tensor."""
    _assert_tensor_equal(_local_nf4(state), torch.chunk(reference_nf4(), world)[rank], f"rank {rank}'s NF4 block")


def _local_nf4(state: dict[str, Any]) -> Any:
    return state["qlora"][0].weight._local_tensor


def _assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    for name in ("qlora", "f8"):
        g, w = got[name], want[name]
        assert sorted(g["model"]) == sorted(w["model"])
        for k, t in w["model"].items():
            _assert_tensor_equal(g["model"][k], t, f"{name} {k}")
        for k, st in w["state"].items():
            for n, t in st.items():
                assert torch.equal(torch.as_tensor(g["state"][k][n]), torch.as_tensor(t)), (name, k, n)


def _assert_tensor_equal(got: torch.Tensor, want: torch.Tensor, where: str) -> None:
    assert type(got) is type(want), where
    if subclasses.is_stored_subclass(want):
        names, ctx = want.__tensor_flatten__()
        assert got.__tensor_flatten__()[0] == names, where
        for n in names:
            assert torch.equal(getattr(got, n), getattr(want, n)), (where, n)
        assert got.__tensor_flatten__()[1] == ctx, where
    else:
        assert torch.equal(got, want), where


def _pair_dtensor(rank: int) -> Any:
    """A DTensor (Shard(0) over the world) whose local tensor is a PairTensor, accepted but without a rule."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    subclasses.allow_tensor_subclasses(PairTensor)
    mesh = world_mesh()
    g = torch.Generator().manual_seed(11)
    a, b = torch.randn(8, 3, generator=g), torch.arange(24, dtype=torch.int32).reshape(8, 3)
    rows = slice(rank * 4, rank * 4 + 4)
    local = PairTensor(a[rows].clone(), b[rows].clone(), "pair")
    spec = DTensorSpec(mesh, (Shard(0),), TensorMeta(torch.Size((8, 3)), (3, 1), torch.float32))
    return DTensor(local, spec, requires_grad=False)


def save_on_4(rank: int, world: int, root: str) -> None:
    state = _models(0)
    _train(state, 2, seed=5)
    with CheckpointManager(Path(root) / "r4", state, mode="sharded", **OPTS) as mgr:
        mgr.save(2)
    want = _gathered(state)
    if rank == 0:
        torch.save(want, Path(root) / "want.pt")


def restore_on_2(rank: int, world: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    state = _models(1)
    _train(state, 1, seed=9)  # optimizer state to restore into
    local = _local_nf4(state)
    ptrs = {n: getattr(local, n).data_ptr() for n in INNER}
    with CheckpointManager(Path(root) / "r4", state, mode="sharded", **OPTS) as mgr:
        out["resharded"] = mgr.restore_latest()
    assert _local_nf4(state) is local and {n: getattr(local, n).data_ptr() for n in INNER} == ptrs
    want = torch.load(Path(root) / "want.pt", weights_only=True)
    _assert_same(_gathered(state), want)  # 4 -> 2, bit for bit
    _assert_local_nf4(state, rank, world)

    # same mesh: saved and restored on these 2 ranks, into the very local subclasses
    _train(state, 1, seed=13)
    pair = _pair_dtensor(rank)
    with CheckpointManager(Path(root) / "r2", state, mode="sharded", **OPTS) as mgr:
        mgr.save(3)
    with CheckpointManager(Path(root) / "pair", {"pair": pair}, mode="sharded", **OPTS) as mgr:
        mgr.save(3)
    saved = _gathered(state)
    saved_inner = {n: getattr(local, n).clone() for n in INNER}
    saved_pair = (pair._local_tensor.a.clone(), pair._local_tensor.b.clone())
    f8_local = state["f8"][0].weight._local_tensor
    f8_ptr = f8_local._tensor.data_ptr()
    with torch.no_grad():
        for n in INNER:
            getattr(local, n).zero_()
        pair._local_tensor.a.zero_()
        pair._local_tensor.b.zero_()
    _train(state, 2, seed=17)
    with CheckpointManager(Path(root) / "r2", state, mode="sharded", **OPTS) as mgr:
        out["same_mesh"] = mgr.restore_latest()
    with CheckpointManager(Path(root) / "pair", {"pair": pair}, mode="sharded", **OPTS) as mgr:
        out["pair_same_mesh"] = mgr.restore_latest()
    assert _local_nf4(state) is local and {n: getattr(local, n).data_ptr() for n in INNER} == ptrs
    assert state["f8"][0].weight._local_tensor._tensor.data_ptr() == f8_ptr
    for n in INNER:
        assert torch.equal(getattr(local, n), saved_inner[n]), n
    _assert_local_nf4(state, rank, world)
    assert torch.equal(pair._local_tensor.a, saved_pair[0]) and torch.equal(pair._local_tensor.b, saved_pair[1])
    _assert_same(_gathered(state), saved)
    out["local_classes"] = [type(local).__name__, type(f8_local).__name__]

    # full mode (the gathered state dict: plain fp32 master weights) restores the float8 model too
    f8 = {"f8": state["f8"], "f8opt": state["f8opt"]}
    with CheckpointManager(Path(root) / "full", f8, mode="full", **OPTS) as mgr:
        mgr.save(4)
    saved_f8 = gathered_state(state["f8"], state["f8opt"])
    _train(state, 1, seed=19)
    with CheckpointManager(Path(root) / "full", f8, mode="full", **OPTS) as mgr:
        out["full"] = mgr.restore_latest()
    _assert_same({"qlora": saved["qlora"], "f8": gathered_state(state["f8"], state["f8opt"])}, {"qlora": saved["qlora"], "f8": saved_f8})
    return out


@pytest.fixture
def pair_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    """PairTensor accepted in this test only (and no inner-sharding rule for it unless the test registers one)."""
    monkeypatch.setattr(subclasses, "ALLOWED", dict(subclasses.ALLOWED))
    monkeypatch.setattr(subclass_sharding, "RULES", dict(subclass_sharding.RULES))
    checkpointd.allow_tensor_subclasses(PairTensor)


@pytest.fixture(scope="module")
def steps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``r4``: QLoRA + float8 saved on 4 ranks; ``r2``: restored on 2 (resharded), trained, saved there;
    ``pair``: a DTensor of PairTensor local tensors saved on 2 ranks; ``full``: the float8 model in full mode."""
    root = tmp_path_factory.mktemp("sharded-subclasses")
    run_distributed(save_on_4, 4, str(root), deadline_secs=120)
    results = run_distributed(restore_on_2, 2, str(root), deadline_secs=120)
    for r in results:
        assert r == {"resharded": 2, "same_mesh": 3, "pair_same_mesh": 3, "full": 4,
                     "local_classes": ["NF4Tensor", "WeightWithDynamicFloat8CastTensor"]}
    return root


def test_reshard_4_to_2_and_same_mesh_restores_bit_exact_in_place(steps: Path) -> None:
    """Asserted on every rank by the fixture's runs; here, the records the manifest holds for the NF4 base."""
    records = json.loads((steps / "r4" / "step-000000002" / "manifest.json").read_text())["extra"]["sharded"]["tensors"]
    nf4 = records["qlora"][f'["{NF4}"]']
    assert nf4["subclass"]["class"] == "torchao.quantization.quantize_.workflows.nf4.nf4_tensor.NF4Tensor"
    assert sorted(nf4["subclass"]["inner"]) == sorted(INNER)
    assert [b["inner_shapes"]["quantization_factor"] for b in nf4["blocks"]] == [[1]] * 4
    assert all(b["ctx"]["tensor_meta"]["fields"]["original_shape"] == [64, 256] for b in nf4["blocks"])


def test_load_gives_the_global_nf4_and_a_single_process_restore(steps: Path) -> None:
    ref = reference_nf4()
    for root in ("r4", "r2"):  # 4 -> 1 and 2 -> 1
        _assert_tensor_equal(checkpointd.load(steps / root)["qlora"][NF4], ref, f"NF4 via load of {root}")
    model = nn.Sequential(LoRALinear(256, 256))
    live = model[0].weight
    ptrs = {n: getattr(live, n).data_ptr() for n in INNER}
    with CheckpointManager(steps / "r2", {"qlora": model}, **OPTS) as mgr:
        assert mgr.restore_latest(entries=["qlora"]) == 3
    assert model[0].weight is live and {n: getattr(live, n).data_ptr() for n in INNER} == ptrs  # in place
    _assert_tensor_equal(live, ref, "NF4 restored in one process")
    f8 = checkpointd.load(steps / "r4")["f8"]["0.weight"]  # the float8 all-gather weight, whole: its fp32 master weight
    want = torch.load(steps / "want.pt", weights_only=True)["f8"]["model"]["0.weight"]
    assert type(f8).__name__ == "WeightWithDynamicFloat8CastTensor" and torch.equal(f8._tensor, want)
    with pytest.warns(UserWarning, match="not bit-exact"):
        plain = checkpointd.load(steps / "r2", dequantize=True)
    assert type(plain["qlora"][NF4]) is torch.Tensor
    assert torch.equal(plain["qlora"][NF4], ref.get_original_weight())


def test_reshard_cutting_nf4_groups_is_refused(steps: Path) -> None:
    """A target whose rows cut NF4's quantization-factor groups (one per 64 rows here) is refused by the rule
    (FSDP2 itself never makes such a shard: NF4 refuses to split so; the leaf is asked directly)."""
    store = Store(steps / "r4")
    manifest: Manifest = commit.read_committed_manifest(store, "step-000000002")
    leaf = sharded_values(manifest, read_step(store, "step-000000002", manifest, rank=None))["qlora"][NF4]
    live = to_nf4(torch.randn(64, 256, dtype=torch.bfloat16))  # 64 rows, but starting at row 32 of a 64-row group
    with pytest.raises(StateMismatchError, match=r"rows \[32, 96\) do not fall on the groups of .*NF4Tensor"):
        leaf.pairs_for(live, (32, 0), (64, 256), "NF4 base")
    whole = to_nf4(torch.randn(128, 256, dtype=torch.bfloat16))
    pairs = leaf.pairs_for(whole, (64, 0), (128, 256), "NF4 base")  # on group boundaries: rows 64-191
    assert [tuple(dst.shape) for dst, _ in pairs] == [tuple(getattr(whole, n).shape) for n in INNER]
    middle = torch.cat([torch.chunk(reference_nf4(), 4)[i].quantized_data for i in (1, 2)])
    assert torch.equal(pairs[0][1], middle)


def test_class_without_rule_is_not_resharded_until_registered(steps: Path, pair_allowed: None,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    name = subclasses.qualname(PairTensor)
    with pytest.raises(StateMismatchError, match=r"saved on mesh \(2,\) with a .*PairTensor local tensor; resharding it .*"
                       r"register_inner_sharding.*restore on the same mesh.*dequantize=True"):
        checkpointd.load(steps / "pair")
    monkeypatch.setitem(DEQUANTIZERS, name, lambda t: t.a)
    with pytest.warns(UserWarning, match="not bit-exact"):
        plain = checkpointd.load(steps / "pair", dequantize=True)
    g = torch.Generator().manual_seed(11)
    a = torch.randn(8, 3, generator=g)
    assert type(plain["pair"]) is torch.Tensor and torch.equal(plain["pair"], a)
    checkpointd.register_inner_sharding(PairTensor, {"a": "rows", "b": "rows"})
    whole = checkpointd.load(steps / "pair")["pair"]
    assert type(whole) is PairTensor and whole.shape == (8, 3) and whole.tag == "pair"
    assert torch.equal(whole.a, a) and torch.equal(whole.b, torch.arange(24, dtype=torch.int32).reshape(8, 3))


def test_class_not_accepted_is_refused_before_unpickling(steps: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    load_module = sys.modules["checkpointd.load"]
    monkeypatch.setattr(subclasses, "ALLOWED", {})

    def no_read(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a shard file was read")

    monkeypatch.setattr(load_module, "read_step", no_read)
    with pytest.raises(UnacceptedSubclassError, match=r"holds a tensor subclass subclasses.pair_tensor.PairTensor, which "
                       r"checkpointd does not accept; nothing of it was run.*allow_tensor_subclasses\(PairTensor\)"):
        checkpointd.load(steps / "pair")
    # every rank's blocks are listed in the sharded records, which are checked as well (rank 0's file alone in
    # extra["subclasses"]): the distributed restore and a single-process restore check both before reading
    sharded = json.loads((steps / "pair" / "step-000000003" / "manifest.json").read_text())["extra"]["sharded"]
    assert [b["rank"] for b in sharded["tensors"]["pair"]["[]"]["blocks"]] == [0, 1]
    with pytest.raises(UnacceptedSubclassError, match=r"entry 'pair' tensor \[\] holds a tensor subclass .*PairTensor"):
        subclasses.check_sharded_described(sharded, "step 3")


def test_export_of_a_sharded_step_refuses_subclasses_or_dequantizes_them(steps: Path, tmp_path: Path) -> None:
    """safetensors holds plain tensors: the assembled NF4 is refused, or written dequantized on request."""
    from safetensors.torch import load_file

    from checkpointd.cli import main
    from checkpointd.cli.exits import EXIT_OK, EXIT_USAGE

    step_dir = steps / "r4" / "step-000000002"
    assert main(["export", str(step_dir), str(tmp_path / "refused"), "--format", "safetensors"]) == EXIT_USAGE
    assert main(["export", str(step_dir), str(tmp_path / "st"), "--format", "safetensors", "--dequantize"]) == EXIT_OK
    weights = load_file(str(tmp_path / "st" / "qlora.safetensors"))
    assert torch.equal(weights[NF4], reference_nf4().get_original_weight())
