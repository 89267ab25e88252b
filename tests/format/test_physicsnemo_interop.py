"""Interop with the real PhysicsNeMo 2.2.2 (core tier), run in its own venv through subprocesses.

checkpointd never imports PhysicsNeMo; these tests check the files both ways:
PhysicsNeMo loads the ``.mdlus`` files we write, and we read the ones it writes (zip and tar).
The model classes live in tests/pn_scripts/pn_models.py; each PhysicsNeMo call batches several checks
because importing PhysicsNeMo takes seconds.
"""

from __future__ import annotations

import json
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from checkpointd.format.mdlus import (
    load_mdlus_state_dict,
    mdlus_json_members,
    read_mdlus_json,
    write_mdlus,
)
from checkpointd.format.serialize import plan_pt

try:  # pytest puts tests/ on sys.path unless tests/ becomes a package
    from physicsnemo_env import SCRIPTS_DIR, physicsnemo_python, run_in_physicsnemo
except ImportError:  # pragma: no cover
    from tests.physicsnemo_env import SCRIPTS_DIR, physicsnemo_python, run_in_physicsnemo

__all__ = ["physicsnemo_python"]  # the fixture, re-exported so pytest finds it here

INTEROP_SCRIPT = SCRIPTS_DIR / "interop.py"


class StandIn:
    """A duck-typed PhysicsNeMo module: only ``_args`` and ``__model_checkpoint_version__``."""

    def __init__(self, tree: dict[str, Any]) -> None:
        args = tree["args"]
        init_args = {
            name: StandIn(value["__nested__"]) if isinstance(value, dict) and "__nested__" in value else value
            for name, value in args["__args__"].items()
        }
        self._args = {**args, "__args__": init_args}
        self.__model_checkpoint_version__ = tree["version"]


@pytest.fixture(scope="module")
def pn_export(physicsnemo_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with PhysicsNeMo's reference state, args and its own .mdlus files (interop.py export)."""
    out = tmp_path_factory.mktemp("pn_export")
    run_in_physicsnemo(physicsnemo_python, INTEROP_SCRIPT, "export", str(out))
    return out


def _expected_state(folder: Path) -> dict[str, torch.Tensor]:
    return torch.load(folder / "state.pt", weights_only=True)


def _assert_same_tensors(got: dict[str, Any], expected: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(expected)
    for key, tensor in expected.items():
        assert torch.equal(got[key], tensor), key
        assert got[key].stride() == tensor.stride(), key


def test_json_members_match_physicsnemo_byte_for_byte(pn_export: Path) -> None:
    stand_in = StandIn(json.loads((pn_export / "args_tree.json").read_text()))
    with zipfile.ZipFile(pn_export / "pn_zip.mdlus") as zf:
        theirs = {name: zf.read(name) for name in ("args.json", "metadata.json")}
    ours = mdlus_json_members(stand_in)
    assert ours == theirs
    assert b"__physicsnemo.Module__.encoder.act" in ours["args.json"]
    assert b"Infinity" in ours["args.json"]


def test_physicsnemo_loads_our_mdlus(physicsnemo_python: Path, pn_export: Path) -> None:
    stand_in = StandIn(json.loads((pn_export / "args_tree.json").read_text()))
    with open(pn_export / "ours.mdlus", "wb") as f:
        write_mdlus(f, mdlus_json_members(stand_in), plan_pt(_expected_state(pn_export)))

    out = run_in_physicsnemo(physicsnemo_python, INTEROP_SCRIPT, "check-mdlus", str(pn_export))

    for check in ("TinyNet.from_checkpoint", "Module.from_checkpoint", "Module.load"):
        assert f"OK {check}\n" in out


@pytest.mark.parametrize("name", ["pn_zip.mdlus", "pn_tar.mdlus"])
def test_we_read_physicsnemo_mdlus(pn_export: Path, name: str) -> None:
    path = pn_export / name
    assert tarfile.is_tarfile(path) == (name == "pn_tar.mdlus")  # the zip must not pass as a tar
    with open(path, "rb") as f:
        state = load_mdlus_state_dict(f)
        args, metadata = read_mdlus_json(f)

    _assert_same_tensors(state, _expected_state(pn_export))
    assert state["conv.weight"].is_contiguous(memory_format=torch.channels_last)
    assert args["__name__"] == "TinyNet" and args["__module__"] == "pn_models"
    assert args["__args__"]["encoder"] == "__physicsnemo.Module__.encoder"
    assert metadata["mdlus_file_version"] == "0.1.0"
    assert metadata["__physicsnemo.Module__.encoder.mdlus_file_version"] == "0.3.0"



def _train(net: torch.nn.Module, plain: torch.nn.Module, optimizer: Any, scheduler: Any, steps: int) -> None:
    """A few real steps, so Adam has moments (channels_last ones for the conv) and StepLR has moved."""
    torch.manual_seed(1)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = net(torch.randn(5, 4)).square().sum() + net.conv(torch.randn(1, 2, 5, 5)).sum()
        (loss + plain(torch.randn(5, 3)).square().sum()).backward()
        optimizer.step()
        scheduler.step()


def test_physicsnemo_load_checkpoint_reads_uncompressed_step_dir(
    physicsnemo_python: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from checkpointd import CheckpointManager

    monkeypatch.syspath_prepend(str(SCRIPTS_DIR))
    import pn_models  # here its classes derive from a duck-typed stand-in, with the same names

    net, plain, optimizer, scheduler = pn_models.build_training(seed=0)
    _train(net, plain, optimizer, scheduler, steps=3)
    state = {"net": net, "plain": plain, "optimizer": optimizer, "scheduler": scheduler}
    with CheckpointManager(tmp_path / "run", state, compression=None) as manager:
        manager.save(7)
        manager.wait()
    expected = {name: obj.state_dict() for name, obj in state.items()}
    torch.save({**expected, "step": 7}, tmp_path / "expected.pt")
    step_dir = tmp_path / "run" / "step-000000007"
    assert (step_dir / "TinyNet.0.7.mdlus").is_file() and (step_dir / "checkpoint.0.7.pt").is_file()

    out = run_in_physicsnemo(
        physicsnemo_python, INTEROP_SCRIPT, "load-step", str(step_dir), str(tmp_path / "expected.pt")
    )

    for check in ("load_checkpoint epoch 7", "load_checkpoint state", "step from_checkpoint", "step weights_only"):
        assert f"OK {check}\n" in out


@pytest.mark.parametrize("step", [None, 1])
def test_load_reads_a_physicsnemo_save_checkpoint_directory(pn_export: Path, step: int | None) -> None:
    """``checkpointd.load`` on a folder PhysicsNeMo's ``save_checkpoint`` wrote: one epoch for every file
    (the newest, or ``step``), models by their PhysicsNeMo names, the training-state keys beside them."""
    from checkpointd import load

    epoch = 2 if step is None else step
    got = load(pn_export / "pn_ckpt", step=step)
    expected = torch.load(pn_export / f"pn_ckpt_expected_{epoch}.pt", weights_only=True)
    assert got["epoch"] == epoch
    assert got["metadata"] == {"loss": float(epoch)}
    for name in ("TinyNet", "Sequential"):
        assert list(got[name]) == list(expected[name])
        for key, tensor in expected[name].items():
            assert torch.equal(got[name][key], tensor), (name, key)
    for index, state in expected["optimizer_state_dict"]["state"].items():
        for key, value in state.items():
            assert torch.equal(got["optimizer_state_dict"]["state"][index][key], value), (index, key)
    assert got["scheduler_state_dict"] == expected["scheduler_state_dict"]
