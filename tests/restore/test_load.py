"""``checkpointd.load`` on every kind of path, and the files of SPEC §3 as other tools read them."""

from __future__ import annotations

import json

import pytest
import torch

from checkpointd import CheckpointManager, CheckpointNotFoundError, load


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.bn = torch.nn.BatchNorm2d(4)


def _train_state():
    torch.manual_seed(0)
    model = Block().to(memory_format=torch.channels_last)
    head0, head1 = torch.nn.Linear(4, 2), torch.nn.Linear(2, 1)
    params = [*model.parameters(), *head0.parameters(), *head1.parameters()]
    opt = torch.optim.Adam(params, lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    scaler = torch.amp.GradScaler("cpu")
    x = torch.randn(2, 3, 5, 5).to(memory_format=torch.channels_last)
    loss = head1(head0(model.bn(model.conv(x)).mean((2, 3)))).sum()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    sched.step()
    return {"model": model, "head_a": head0, "head_b": head1, "optimizer": opt, "scheduler": sched,
            "scaler": scaler, "extra": {"epoch_of_data": 3, "names": ["a"]}, "ema": torch.arange(4.0)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Step 0 and step 7 of one run, compressed and uncompressed."""
    out = {}
    for compression in (None, "zstd"):
        root = tmp_path_factory.mktemp(f"load-{compression}")
        state = _train_state()
        with CheckpointManager(root, state, compression=compression, keep_last=None) as mgr:
            mgr.save(0)
            mgr.save(7, metrics={"loss": 0.25, "note": "ok"})
        out[compression] = (root, state)
    return out


def test_file_names_follow_physicsnemo(saved):
    for compression, suffix in ((None, ""), ("zstd", ".zst")):
        root, _ = saved[compression]
        names = sorted(p.name for p in (root / "step-000000007").iterdir())
        assert names == sorted([
            f"Block.0.7.pt{suffix}", f"Linear0.0.7.pt{suffix}", f"Linear1.0.7.pt{suffix}",
            f"checkpoint.0.7.pt{suffix}", "manifest.json", "COMMITTED",
        ])


def test_uncompressed_files_are_native_torch_files(saved):
    root, state = saved[None]
    step_dir = root / "step-000000007"
    block = torch.load(step_dir / "Block.0.7.pt", weights_only=True)
    assert list(block) == list(state["model"].state_dict())
    assert block["conv.weight"].stride() == state["model"].conv.weight.stride()
    assert block["conv.weight"].is_contiguous(memory_format=torch.channels_last)
    for k, v in state["model"].state_dict().items():
        assert torch.equal(block[k], v), k
    heads = [torch.load(step_dir / f"Linear{i}.0.7.pt", weights_only=True) for i in (0, 1)]
    assert torch.equal(heads[0]["weight"], state["head_a"].weight)  # ids follow insertion order
    assert torch.equal(heads[1]["weight"], state["head_b"].weight)

    training = torch.load(step_dir / "checkpoint.0.7.pt", weights_only=True)
    for key in ("optimizer_state_dict", "scheduler_state_dict", "scaler_state_dict", "epoch", "metadata",
                "extra", "ema"):
        assert key in training, key
    assert training["epoch"] == 7
    assert training["metadata"] == {"loss": 0.25, "note": "ok"}
    assert training["scheduler_state_dict"] == state["scheduler"].state_dict()
    assert training["scaler_state_dict"] == state["scaler"].state_dict()
    assert training["extra"] == {"epoch_of_data": 3, "names": ["a"]}
    opt_state = training["optimizer_state_dict"]["state"][0]
    assert opt_state["exp_avg"].is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(opt_state["exp_avg"], state["optimizer"].state[state["model"].conv.weight]["exp_avg"])

    step0 = torch.load(root / "step-000000000" / "checkpoint.0.0.pt", weights_only=True)
    assert step0["epoch"] == 0 and step0["metadata"] == {}


def test_manifest_records_files_and_codec(saved):
    for compression, codec in ((None, "none"), ("zstd", "zstd")):
        root, _ = saved[compression]
        manifest = json.loads((root / "step-000000007" / "manifest.json").read_text())
        assert manifest["step"] == 7
        files = {f["path"]: f for f in manifest["files"]}
        assert set(files) == {p.name for p in (root / "step-000000007").iterdir()} - {"manifest.json", "COMMITTED"}
        for name, f in files.items():
            assert f["codec"] == codec
            assert f["size"] == (root / "step-000000007" / name).stat().st_size


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_load_root_step_dir_and_step(saved, compression):
    root, state = saved[compression]
    latest = load(root)
    assert set(latest) == set(state)
    assert load(str(root))["extra"] == latest["extra"]
    assert torch.equal(latest["ema"], state["ema"])
    assert latest["extra"] == {"epoch_of_data": 3, "names": ["a"]}
    assert torch.equal(latest["model"]["conv.weight"], state["model"].conv.weight)
    assert latest["model"]["conv.weight"].is_contiguous(memory_format=torch.channels_last)
    assert latest["scheduler"] == state["scheduler"].state_dict()
    by_dir = load(root / "step-000000007")
    assert torch.equal(by_dir["head_b"]["weight"], state["head_b"].weight)
    assert load(root, step=0)["scheduler"] == load(root / "step-000000000")["scheduler"]
    assert load(root / "step-000000007", step=7)["extra"] == latest["extra"]
    with pytest.raises(CheckpointNotFoundError):
        load(root, step=3)
    with pytest.raises(CheckpointNotFoundError):
        load(root / "step-000000007", step=3)


def test_load_single_files(saved):
    for compression, suffix in ((None, ""), ("zstd", ".zst")):
        root, state = saved[compression]
        block = load(root / "step-000000007" / f"Block.0.7.pt{suffix}")
        assert list(block) == list(state["model"].state_dict())
        assert torch.equal(block["bn.running_var"], state["model"].bn.running_var)
        training = load(root / "step-000000007" / f"checkpoint.0.7.pt{suffix}")
        assert training["epoch"] == 7 and training["metadata"]["loss"] == 0.25


def test_load_missing_paths(tmp_path):
    with pytest.raises(CheckpointNotFoundError):
        load(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointNotFoundError):
        load(tmp_path / "empty")


def test_data_parallel_module_gets_unprefixed_keys(tmp_path):
    inner = torch.nn.Linear(3, 2)
    wrapped = torch.nn.DataParallel(inner)
    assert all(k.startswith("module.") for k in wrapped.state_dict())
    with CheckpointManager(tmp_path, {"model": wrapped}, compression=None) as mgr:
        mgr.save(4)
    step_dir = tmp_path / "step-000000004"
    assert (step_dir / "Linear.0.4.pt").exists()
    sd = torch.load(step_dir / "Linear.0.4.pt", weights_only=True)
    assert sorted(sd) == ["bias", "weight"]
    fresh = torch.nn.DataParallel(torch.nn.Linear(3, 2))
    with CheckpointManager(tmp_path, {"model": fresh}, compression=None) as mgr:
        assert mgr.restore_latest() == 4
    assert torch.equal(fresh.module.weight, inner.weight)
