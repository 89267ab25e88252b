"""``checkpointd export --format dcp|safetensors``: what PyTorch's DCP and safetensors read back, bit for bit.

The DCP directories are read by the real ``torch.distributed.checkpoint.load`` and the safetensors files by
the real ``safetensors.torch.load_file``; every comparison is ``torch.equal``.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

import checkpointd
from checkpointd import CheckpointManager, ConfigError
from checkpointd.cli import main
from checkpointd.export import export_step, safetensors_file_names
from checkpointd.storage.store import Store

REPO = Path(__file__).resolve().parent.parent


class Net(torch.nn.Module):
    """A channels_last conv, a bf16 head and a non-tensor ``_extra_state``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.head = torch.nn.Linear(4, 2).to(torch.bfloat16)
        self.note = "v1"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv(x).mean((2, 3)).to(torch.bfloat16)).float()

    def get_extra_state(self) -> Any:
        return {"note": self.note}

    def set_extra_state(self, state: Any) -> None:
        self.note = state["note"]


class Tied(torch.nn.Module):
    """An embedding and an output layer that share one weight."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(5, 3)
        self.out = torch.nn.Linear(3, 5, bias=False)
        self.out.weight = self.embed.weight


def _build(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    net = Net().to(memory_format=torch.channels_last)
    tied = Tied()
    opt = torch.optim.Adam([*net.parameters(), *tied.parameters()], lr=0.01)
    return {"model": net, "tied": tied, "optimizer": opt}


def _train(state: dict[str, Any], steps: int = 2) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(2, 3, 5, 5, generator=g).to(memory_format=torch.channels_last)
        loss = state["model"](x).sum() + state["tied"].out(state["tied"].embed(torch.tensor([1, 2]))).sum()
        loss.backward()
        state["optimizer"].step()
        state["optimizer"].zero_grad()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A zstd-compressed full-mode step 3 and the live state it was saved from."""
    root = tmp_path_factory.mktemp("export") / "root"
    state = _build(0)
    _train(state)
    with CheckpointManager(str(root), {**state, "extra": {"epoch_of_data": 2, "tags": ["a"]}}, compression="zstd") as mgr:
        mgr.save(3)
    return root / "step-000000003", state


def _export(step_dir: Path, out: Path | str, fmt: str, **kwargs: Any) -> list[Any]:
    return export_step(Store(str(step_dir)), "", Store(str(out)), format=fmt, **kwargs)


def _dcp_load(target: dict[str, Any], out: Path) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(target, checkpoint_id=str(out), no_dist=True)


def _assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert sorted(got) == sorted(want)
    for k, t in want.items():
        if isinstance(t, torch.Tensor):
            assert torch.equal(got[k], t), k
            assert got[k].dtype == t.dtype, k


# -- dcp ------------------------------------------------------------------------------------------------
def test_dcp_round_trip_into_fresh_objects(saved: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    step_dir, live = saved
    out = tmp_path / "dcp"
    files = _export(step_dir, out, "dcp")
    assert [Path(f.target).name for f in files] == ["__0_0.distcp", ".metadata"]
    assert sorted(p.name for p in out.iterdir()) == [".metadata", "__0_0.distcp"]

    fresh = _build(7)  # different values everywhere
    both = torch.nn.ModuleDict({"model": fresh["model"], "tied": fresh["tied"]})
    get_optimizer_state_dict(both, fresh["optimizer"])  # gives the optimizer the state dcp.load fills
    target = {name: fresh[name].state_dict() for name in ("model", "tied", "optimizer")}
    target["extra"] = {"epoch_of_data": 0, "tags": []}
    _dcp_load(target, out)
    for name in ("model", "tied"):
        fresh[name].load_state_dict(target[name])
    fresh["optimizer"].load_state_dict(target["optimizer"])

    _assert_same(fresh["model"].state_dict(), live["model"].state_dict())
    _assert_same(fresh["tied"].state_dict(), live["tied"].state_dict())
    assert fresh["model"].note == "v1"  # a non-tensor value (_extra_state), set by dcp.load
    assert fresh["model"].conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert fresh["model"].head.weight.dtype == torch.bfloat16
    assert target["extra"] == {"epoch_of_data": 2, "tags": ["a"]}
    got, want = fresh["optimizer"].state_dict(), live["optimizer"].state_dict()
    assert got["param_groups"] == want["param_groups"]
    assert sorted(got["state"]) == sorted(want["state"]) == list(range(5))
    for i, st in want["state"].items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(got["state"][i][key], st[key]), (i, key)
    assert got["state"][2]["exp_avg"].dtype == torch.bfloat16  # the bf16 head's moments


def test_dcp_export_is_what_checkpointd_load_reads(saved: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    step_dir, _ = saved
    out = tmp_path / "dcp"
    _export(step_dir, out, "dcp")
    want = checkpointd.load(str(step_dir))
    got = checkpointd.load(str(out))
    assert sorted(got) == sorted(want) == ["extra", "model", "optimizer", "tied"]
    _assert_same(got["model"], want["model"])
    assert got["model"]["_extra_state"] == {"note": "v1"}
    # DCP keeps dict keys as strings: the optimizer's parameter indices come back as "0", "1", ...
    assert sorted(got["optimizer"]["state"]) == ["0", "1", "2", "3", "4"]
    for i, st in want["optimizer"]["state"].items():
        _assert_same(got["optimizer"]["state"][str(i)], st)
    assert got["optimizer"]["param_groups"] == want["optimizer"]["param_groups"]


def test_dcp_refuses_a_non_empty_out_dir(saved: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    step_dir, _ = saved
    out = tmp_path / "dcp"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not empty.*--overwrite"):
        _export(step_dir, out, "dcp")
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    (out / "__3_0.distcp").write_bytes(b"stale")  # a DCP file of another checkpoint: removed by overwrite
    _export(step_dir, out, "dcp", overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == [".metadata", "__0_0.distcp", "notes.txt"]
    assert checkpointd.load(str(out))["extra"] == {"epoch_of_data": 2, "tags": ["a"]}


def test_dcp_export_to_an_fsspec_url(saved: tuple[Path, dict[str, Any]]) -> None:
    """A remote OUT_DIR: written locally by DCP, then uploaded through the store (memory:// here)."""
    step_dir, live = saved
    url = "memory://checkpointd-export-test/dcp"
    try:
        files = _export(step_dir, url, "dcp")
        assert [f.target for f in files] == [f"{url}/__0_0.distcp", f"{url}/.metadata"]
        got = checkpointd.load(url)
        _assert_same(got["tied"], live["tied"].state_dict())
    finally:
        Store("memory://checkpointd-export-test").remove_tree("")


def test_dcp_export_leaves_nothing_when_the_step_is_damaged(saved: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    damaged = tmp_path / "step-000000003"
    damaged.mkdir()
    for p in saved[0].iterdir():
        data = bytearray(p.read_bytes())
        if p.name.startswith("checkpoint."):
            data[len(data) // 2] ^= 0xFF
        (damaged / p.name).write_bytes(bytes(data))
    out = tmp_path / "dcp"
    with pytest.raises(checkpointd.CorruptCheckpointError, match="checksum"):
        _export(damaged, out, "dcp")
    assert not out.exists() or not list(out.iterdir())


# -- safetensors ----------------------------------------------------------------------------------------
def test_safetensors_round_trip(saved: tuple[Path, dict[str, Any]], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    step_dir, live = saved
    out = tmp_path / "st"
    with caplog.at_level(logging.WARNING, logger="checkpointd"):
        files = _export(step_dir, out, "safetensors")
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors", "tied.safetensors"]
    by_name = {Path(f.target).name: f for f in files}
    assert by_name["model.safetensors"].skipped == ["_extra_state"]
    assert by_name["tied.safetensors"].skipped == []
    assert "_extra_state" in caplog.text and "model.safetensors" in caplog.text

    fresh = _build(7)
    for name in ("model", "tied"):
        path = out / f"{name}.safetensors"
        with safe_open(str(path), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
        tensors = load_file(str(path))
        want = live[name].state_dict()
        assert sorted(tensors) == sorted(k for k in want if k != "_extra_state")  # the names state_dict() uses
        missing, unexpected = fresh[name].load_state_dict(tensors, strict=False)
        assert unexpected == [] and missing == (["_extra_state"] if name == "model" else [])
        _assert_same({k: v for k, v in fresh[name].state_dict().items() if k != "_extra_state"},
                     {k: v for k, v in want.items() if k != "_extra_state"})
    tied = load_file(str(out / "tied.safetensors"))  # the tied weight is written under both names (cloned)
    assert torch.equal(tied["embed.weight"], tied["out.weight"])
    assert fresh["tied"].out.weight is fresh["tied"].embed.weight  # still tied after load_state_dict
    assert fresh["model"].head.weight.dtype == torch.bfloat16
    assert fresh["model"].conv.weight.is_contiguous(memory_format=torch.channels_last)


def test_safetensors_refuses_existing_files(saved: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    step_dir, _ = saved
    out = tmp_path / "st"
    out.mkdir()
    (out / "tied.safetensors").write_bytes(b"old")
    with pytest.raises(ConfigError, match="tied.safetensors already exists; pass --overwrite"):
        _export(step_dir, out, "safetensors")
    assert (out / "tied.safetensors").read_bytes() == b"old" and not (out / "model.safetensors").exists()
    _export(step_dir, out, "safetensors", overwrite=True)
    assert sorted(load_file(str(out / "tied.safetensors"))) == ["embed.weight", "out.weight"]


def test_safetensors_file_names() -> None:
    assert safetensors_file_names(["model", "ema.v2", "my model/x", "..hidden"]) == {
        "model": "model.safetensors", "ema.v2": "ema.v2.safetensors", "my model/x": "my_model_x.safetensors",
        "..hidden": "hidden.safetensors"}
    with pytest.raises(ConfigError, match="'a/b' and 'a b' would both be written to a_b.safetensors"):
        safetensors_file_names(["a/b", "a b"])
    with pytest.raises(ConfigError, match="'Model' would both"):
        safetensors_file_names(["model", "Model"])  # one file on a case-insensitive filesystem
    with pytest.raises(ConfigError, match="gives no usable file name"):
        safetensors_file_names(["../"])


def test_safetensors_needs_a_module(tmp_path: Path) -> None:
    root = tmp_path / "root"
    with CheckpointManager(str(root), {"ema": torch.arange(3.0), "extra": {"a": 1}}) as mgr:
        mgr.save(1)
    with pytest.raises(ConfigError, match="holds no nn.Module entry.*use --format dcp"):
        _export(root / "step-000000001", tmp_path / "st", "safetensors")


def test_unknown_format(saved: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown export format 'onnx'; choose one of native, dcp, safetensors"):
        _export(saved[0], tmp_path / "x", "onnx")


# -- command line ---------------------------------------------------------------------------------------
def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_export_formats(saved: tuple[Path, dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    step_dir, live = saved
    code, out, _ = _run(capsys, "export", "--format", "dcp", str(step_dir), str(tmp_path / "dcp"))
    assert code == 0 and ".metadata" in out and "exported 2 file(s)" in out and "(dcp)" in out
    target = {"tied": live["tied"].state_dict()}
    target["tied"] = {k: torch.zeros_like(v) for k, v in target["tied"].items()}
    _dcp_load(target, tmp_path / "dcp")
    _assert_same(target["tied"], live["tied"].state_dict())

    code, out, err = _run(capsys, "export", "--format", "safetensors", str(step_dir), str(tmp_path / "st"))
    assert code == 0 and "model.safetensors" in out and "left out, not tensors: _extra_state" in out
    assert "checkpointd: warning:" in err and "_extra_state" in err
    assert torch.equal(load_file(str(tmp_path / "st" / "tied.safetensors"))["out.weight"], live["tied"].out.weight)

    code, _, err = _run(capsys, "export", "--format", "dcp", str(step_dir), str(tmp_path / "dcp"))
    assert code == 2 and "--overwrite" in err
    assert _run(capsys, "export", "--format", "dcp", "--overwrite", str(step_dir), str(tmp_path / "dcp"))[0] == 0
    code, _, err = _run(capsys, "export", "--format", "onnx", str(step_dir), str(tmp_path / "x"))
    assert code == 2 and "invalid choice: 'onnx'" in err
    code, out, _ = _run(capsys, "export", str(step_dir), str(tmp_path / "native"))  # native stays the default
    assert code == 0 and sorted(p.name for p in (tmp_path / "native").iterdir())[0].endswith(".pt")
    assert _run(capsys, "ls", str(step_dir.parent))[0] == 0
    assert _run(capsys, "inspect", str(step_dir))[0] == 0


# -- the example ----------------------------------------------------------------------------------------
def test_example_runs(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    result = subprocess.run([sys.executable, str(REPO / "examples" / "dcp_safetensors_interop.py"), str(tmp_path)],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "all round trips bit-exact" in result.stdout
