"""A full-mode checkpoint (whole tensor subclasses saved by one process) restored into a model sharded by
FSDP2 on 2 gloo ranks, whose local tensors are subclasses of the same class.

- QLoRA: each rank's local ``NF4Tensor`` takes its rows of the saved NF4's inner tensors through NF4's
  inner-sharding rule, in place (its storages stay), bit for bit against the rows of the unsplit NF4.
  The outer tensor's ``copy_`` of a slice cannot do this: NF4 slices only from row 0 to the end.
- A class without a rule (PairTensor: its ``copy_`` writes only its first inner tensor) keeps that
  ``copy_`` path; once a rule is registered, both inner tensors arrive by rows.
- Rows that cut one of NF4's groups are refused before anything is copied.
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
from checkpointd import CheckpointManager, DistributedOptions, StagingOptions, StateMismatchError
from checkpointd.format import subclass_sharding, subclasses
from checkpointd.restore.sharded_subclasses import WholeSubclassLeaf

pytest.importorskip("torchao")

from subclasses.pair_tensor import PairTensor  # noqa: E402
from subclasses.quantized_models import LoRALinear  # noqa: E402
from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4  # noqa: E402

warnings.filterwarnings("ignore", message=".*KernelPreference.*")
OPTS = dict(mode="full", compression=None, keep_last=None, staging=StagingOptions(freeze_gc=False),
            distributed=DistributedOptions(timeout_secs=30))
INNER = ["quantized_data", "scaler_mean", "quantization_factor", "quantized_scalers", "nf4"]


def qlora(seed: int) -> nn.Module:
    """One 256x256 NF4 base (one quantization factor per 64 rows) with LoRA adapters."""
    torch.manual_seed(seed)
    return nn.Sequential(LoRALinear(256, 256))


def pair_values() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return torch.randn(8, 3, generator=g), torch.arange(24, dtype=torch.int32).reshape(8, 3)


def _zero_pair_dtensor() -> Any:
    """A DTensor (8x3, Shard(0) over the world) whose local tensor is a zero PairTensor."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    rows = 8 // dist.get_world_size()
    local = PairTensor(torch.zeros(rows, 3), torch.zeros(rows, 3, dtype=torch.int32), "pair")
    spec = DTensorSpec(world_mesh(), (Shard(0),), TensorMeta(torch.Size((8, 3)), (3, 1), torch.float32))
    return DTensor(local, spec, requires_grad=False)


def restore_on_2(rank: int, world: int, root: str) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    warnings.filterwarnings("ignore")
    model = qlora(1)
    fully_shard(model, mesh=world_mesh())
    local = model[0].weight._local_tensor
    ptrs = {n: getattr(local, n).data_ptr() for n in INNER}
    with CheckpointManager(Path(root) / "qlora", {"qlora": model}, **OPTS) as mgr:
        out = {"qlora": mgr.restore_latest()}
    assert model[0].weight._local_tensor is local and {n: getattr(local, n).data_ptr() for n in INNER} == ptrs
    want = torch.chunk(qlora(0)[0].weight, world)[rank]
    names, ctx = want.__tensor_flatten__()
    assert local.__tensor_flatten__() == (names, ctx)
    for n in names:
        assert torch.equal(getattr(local, n), getattr(want, n)), n
    ref = qlora(0)[0]
    for n in ("lora_a", "lora_b"):
        assert torch.equal(getattr(model[0], n).full_tensor(), getattr(ref, n)), n

    subclasses.allow_tensor_subclasses(PairTensor)
    a, b = pair_values()
    rows = slice(rank * 4, rank * 4 + 4)
    pair = _zero_pair_dtensor()
    with CheckpointManager(Path(root) / "pair", {"pair": pair}, **OPTS) as mgr:
        out["pair_without_rule"] = mgr.restore_latest()
    # no rule: PairTensor's own copy_ of its slice, which writes the first inner tensor only
    assert torch.equal(pair._local_tensor.a, a[rows]) and not pair._local_tensor.b.any()
    checkpointd.register_inner_sharding(PairTensor, {"a": "rows", "b": "rows"})
    pair = _zero_pair_dtensor()
    with CheckpointManager(Path(root) / "pair", {"pair": pair}, **OPTS) as mgr:
        out["pair_with_rule"] = mgr.restore_latest()
    assert torch.equal(pair._local_tensor.a, a[rows]) and torch.equal(pair._local_tensor.b, b[rows])
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``qlora`` and ``pair``: full-mode checkpoints written by this (single) process."""
    out = tmp_path_factory.mktemp("full-into-sharded")
    with CheckpointManager(out / "qlora", {"qlora": qlora(0)}, **OPTS) as mgr:
        mgr.save(1)
    allowed = dict(subclasses.ALLOWED)
    try:
        checkpointd.allow_tensor_subclasses(PairTensor)
        with CheckpointManager(out / "pair", {"pair": PairTensor(*pair_values(), "pair")}, **OPTS) as mgr:
            mgr.save(1)
    finally:
        subclasses.ALLOWED.clear()
        subclasses.ALLOWED.update(allowed)
    return out


def test_full_nf4_restores_into_fsdp2_shards_by_rows_in_place(root: Path) -> None:
    """Asserted on both ranks (NF4 bit-exact in place; PairTensor by copy_ without a rule, by rows with one)."""
    assert run_distributed(restore_on_2, 2, str(root), deadline_secs=120) == [
        {"qlora": 1, "pair_without_rule": 1, "pair_with_rule": 1}] * 2
    assert subclass_sharding.rule_for(subclasses.qualname(PairTensor)) is None  # registered in the ranks only


def test_rows_cutting_an_nf4_group_are_refused() -> None:
    """FSDP2 never makes such a shard (NF4 refuses to split so): the whole value is asked directly for rows
    starting half-way through a 64-row group, then for rows on group boundaries."""
    whole = qlora(0)[0].weight
    leaf = WholeSubclassLeaf(whole, "NF4 base")
    live = to_nf4(torch.randn(64, 256, dtype=torch.bfloat16))
    with pytest.raises(StateMismatchError, match=r"NF4 base: rows \[32, 96\) do not fall on the groups of .*NF4Tensor"):
        leaf.pairs_for(live, (32, 0), (64, 256), "NF4 base")
    pairs = leaf.pairs_for(live, (64, 0), (64, 256), "NF4 base")
    want = torch.chunk(whole, 4)[1]
    assert [tuple(dst.shape) for dst, _ in pairs] == [tuple(getattr(live, n).shape) for n in INNER]
    for (_, src), n in zip(pairs, INNER):
        assert torch.equal(src, getattr(want, n)), n
