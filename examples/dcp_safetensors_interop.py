"""Hand a checkpointd checkpoint to PyTorch DCP and safetensors, and read a DCP checkpoint with checkpointd.

    python examples/dcp_safetensors_interop.py [WORK_DIR]     # a few seconds on CPU

1. Train a small CNN (channels_last) with Adam, checkpoint it with a ``CheckpointManager``.
2. Export the step twice, as the command line does::

       checkpointd export WORK_DIR/ckpt/step-000000003 WORK_DIR/dcp --format dcp
       checkpointd export WORK_DIR/ckpt/step-000000003 WORK_DIR/safetensors --format safetensors

3. Load the DCP directory with ``torch.distributed.checkpoint.load`` into a fresh model and optimizer,
   and the safetensors file with ``safetensors.torch.load_file``: both bit-exact.
4. Write a DCP checkpoint with ``dcp.save`` (as TorchTitan does) and read it with ``checkpointd.load``,
   which never runs code from the files.
"""

from __future__ import annotations

import sys
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

import checkpointd
from checkpointd import CheckpointManager
from checkpointd.export import export_step
from checkpointd.storage.store import Store

warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # no_dist=True is the intent


def make(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 4))
    model = model.to(memory_format=torch.channels_last)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def main(work: Path) -> None:
    # 1. train and checkpoint
    model, opt = make(0)
    with CheckpointManager(work / "ckpt", {"model": model, "optimizer": opt}) as mgr:
        for step in range(1, 4):
            x = torch.randn(4, 3, 8, 8).to(memory_format=torch.channels_last)
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        mgr.save(step)
    step_dir = work / "ckpt" / "step-000000003"

    # 2. export (the Python API of `checkpointd export --format ...`)
    for fmt in ("dcp", "safetensors"):
        for f in export_step(Store(str(step_dir)), "", Store(str(work / fmt)), format=fmt, overwrite=True):
            print(f"{fmt:>11}: {f.target} ({f.native_bytes} bytes)")

    # 3a. DCP: load in place into a fresh model and an optimizer that has state (DCP fills existing keys)
    model2, opt2 = make(1)
    get_optimizer_state_dict(model2, opt2)  # creates Adam's state (a step with zero grads)
    target = {"model": model2.state_dict(), "optimizer": opt2.state_dict()}
    dcp.load(target, checkpoint_id=str(work / "dcp"), no_dist=True)
    model2.load_state_dict(target["model"])
    opt2.load_state_dict(target["optimizer"])
    assert same(model2.state_dict(), model.state_dict())
    for i, st in opt.state_dict()["state"].items():
        assert same(opt2.state_dict()["state"][i], st), i
    assert model2[0].weight.is_contiguous(memory_format=torch.channels_last)
    print("dcp.load: model and Adam moments bit-exact")

    # 3b. safetensors: the model's state_dict() names, loaded with strict=True
    model3, _ = make(2)
    model3.load_state_dict(load_file(str(work / "safetensors" / "model.safetensors")))
    assert same(model3.state_dict(), model.state_dict())
    print("safetensors.torch.load_file: model bit-exact")

    # 4. a DCP checkpoint written by PyTorch, read by checkpointd.load (keys as DCP flattened them)
    dcp.save({"model": model.state_dict(), "train_state": {"step": 3, "tokens_seen": [128, 256]}},
             checkpoint_id=str(work / "titan" / "step-3"), no_dist=True)
    loaded = checkpointd.load(str(work / "titan"))  # a folder of step-N DCP directories: the newest
    assert same(loaded["model"], model.state_dict())
    assert loaded["train_state"] == {"step": 3, "tokens_seen": [128, 256]}
    print("checkpointd.load of a DCP directory: bit-exact")
    print("all round trips bit-exact")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(Path(sys.argv[1]))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            main(Path(tmp))
