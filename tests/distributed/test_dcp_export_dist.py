"""DCP interop of sharded state from a real 2-rank gloo run (FSDP2, uneven ``Shard(0)``).

One run writes the same training state twice: a checkpointd ``mode="sharded"`` step, and a DCP directory
by ``torch.distributed.checkpoint.save`` of the FSDP2 state dicts (one chunk per rank and tensor). Then,
in one process: ``checkpointd.load`` of the DCP directory assembles the chunks; ``checkpointd export
--format dcp`` of the sharded step is loaded by ``dcp.load`` into a plain model and the FQN-keyed optimizer
state of ``get_optimizer_state_dict``. Both equal the gathered state of the run, bit for bit.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from dist_harness import fsdp2_with_adamw, gathered_state, run_distributed, train_same_batches

import checkpointd
from checkpointd import CheckpointManager, DistributedOptions
from checkpointd.export import export_step
from checkpointd.storage.store import Store


class Uneven(nn.Module):
    """``b`` has 5 output rows: Shard(0) over 2 ranks gives 3 and 2."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def save_sharded_and_dcp(rank: int, world: int, root: str, dcp_dir: str) -> Any:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model, opt = fsdp2_with_adamw(Uneven, seed=0)
    train_same_batches(model, opt, 2, seed=4, features=6)
    with CheckpointManager(root, {"model": model, "optimizer": opt}, mode="sharded",
                           distributed=DistributedOptions(timeout_secs=30)) as mgr:
        mgr.save(2)
    dcp.save({"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt)},
             checkpoint_id=dcp_dir)
    full = gathered_state(model, opt)  # collective
    return full if rank == 0 else None


def _assert_equal_to(want: dict[str, Any], model_sd: dict[str, Any], opt_state: dict[str, Any]) -> None:
    assert sorted(model_sd) == sorted(want["model"])
    for k, t in want["model"].items():
        assert torch.equal(model_sd[k], t), k
    assert sorted(opt_state) == sorted(want["state"])
    for fqn, st in want["state"].items():
        for key, t in st.items():
            assert torch.equal(torch.as_tensor(opt_state[fqn][key]), torch.as_tensor(t)), (fqn, key)


def test_dcp_of_sharded_state(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    root, dcp_dir = tmp_path / "root", tmp_path / "dcp"
    want = run_distributed(save_sharded_and_dcp, 2, str(root), str(dcp_dir), deadline_secs=120)[0]
    assert sorted(p.name for p in dcp_dir.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]

    # a DCP directory written by two ranks, read whole
    got = checkpointd.load(str(dcp_dir))
    _assert_equal_to(want, got["model"], got["optimizer"]["state"])
    assert got["optimizer"]["param_groups"][0]["params"] == want["groups"][0]["params"]

    # the sharded checkpointd step, exported to DCP and loaded by PyTorch into plain objects
    out = tmp_path / "exported"
    export_step(Store(str(root / "step-000000002")), "", Store(str(out)), format="dcp")
    torch.manual_seed(9)
    model = Uneven()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    target = {"model": model.state_dict(), "optimizer": get_optimizer_state_dict(model, opt)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(target, checkpoint_id=str(out), no_dist=True)
    model.load_state_dict(target["model"])
    set_optimizer_state_dict(model, opt, target["optimizer"])
    _assert_equal_to(want, model.state_dict(), get_optimizer_state_dict(model, opt)["state"])
