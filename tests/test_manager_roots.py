"""Roots (SPEC §1): a local path string, a ``pathlib.Path``, a ``file://`` URL and ``memory://``
all save, list, restore and ``load`` the same way."""

from __future__ import annotations

import json
import logging
import uuid

import fsspec
import pytest
import torch

from checkpointd import CheckpointManager, load, options
from checkpointd.native import planes as planes_native


def _state(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return {"model": model, "optimizer": opt, "counters": {"seen": seed}, "t": torch.full((3,), float(seed))}


def _root(kind: str, tmp_path):
    if kind == "str":
        return str(tmp_path / "ckpt")
    if kind == "path":
        return tmp_path / "ckpt"
    if kind == "file-url":
        return f"file://{tmp_path}/ckpt"
    return f"memory://checkpointd-tests/{uuid.uuid4().hex}"


@pytest.mark.parametrize("kind", ["str", "path", "file-url", "memory"])
@pytest.mark.parametrize("compression", [None, "zstd"])
def test_save_and_restore_on_every_root(tmp_path, kind, compression):
    root = _root(kind, tmp_path)
    saved = _state(1)
    with CheckpointManager(root, saved, compression=compression, keep_last=2) as mgr:
        for step in (10, 20, 30):
            saved["counters"]["seen"] = step
            mgr.save(step)
        mgr.wait()
        assert mgr.steps() == [20, 30]
    live = _state(2)
    with CheckpointManager(root, live, compression=compression) as mgr:
        assert mgr.latest_step() == 30
        assert mgr.restore_latest() == 30
        mgr.restore(20)  # any committed step
    assert live["counters"] == {"seen": 20}
    for a, b in zip(saved["model"].state_dict().values(), live["model"].state_dict().values()):
        assert torch.equal(a, b)
    assert torch.equal(live["t"], saved["t"])
    assert live["optimizer"].state_dict()["state"][0]["exp_avg"].equal(saved["optimizer"].state_dict()["state"][0]["exp_avg"])
    loaded = load(root)
    assert loaded["counters"] == {"seen": 30}
    assert load(root, step=20)["counters"] == {"seen": 20}


def test_memory_root_files_are_in_the_memory_filesystem():
    root = f"memory://checkpointd-tests/{uuid.uuid4().hex}"
    with CheckpointManager(root, {"t": torch.ones(2)}, compression=None) as mgr:
        mgr.save(5)
    fs = fsspec.filesystem("memory")
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root.replace("memory://", "/") + "/step-000000005", detail=False))
    assert names == ["COMMITTED", "checkpoint.0.5.pt", "manifest.json"]
    assert torch.equal(load(root + "/step-000000005")["t"], torch.ones(2))


def test_root_is_created_when_missing(tmp_path):
    root = tmp_path / "a" / "b" / "c"
    with CheckpointManager(root, {"t": torch.ones(1)}) as mgr:
        mgr.save(0)
    assert (root / "step-000000000" / "COMMITTED").exists()


@pytest.mark.parametrize("kind, codec", [("str", "none"), ("path", "none"), ("file-url", "none"),
                                         ("memory", "zstd-planes")])
def test_the_default_compression_is_none_on_local_roots_and_planes_on_remote_ones(tmp_path, kind, codec):
    """``compression="auto"``: local storage takes native bytes faster than the CPU compresses them."""
    root = _root(kind, tmp_path)
    with CheckpointManager(root, _state(1)) as mgr:
        mgr.save(1)
        assert mgr.stats()["codec"] == codec
    with fsspec.open(f"{root}/step-000000001/manifest.json", "rb") as f:
        names = [entry["path"] for entry in json.loads(f.read())["files"]]
    assert names and all(n.endswith(".zst") for n in names) == (codec == "zstd-planes")


def test_auto_takes_plain_zstd_on_remote_roots_without_the_native_plane_kernels(monkeypatch, caplog):
    """The NumPy plane coder is far slower than plain zstd: without the native kernels a remote root gets
    ``"zstd"``, and the log says why; local roots stay native."""
    monkeypatch.setenv(options.NATIVE_ENV, "0")
    planes_native.reset()
    try:
        root = f"memory://checkpointd-tests/{uuid.uuid4().hex}"
        with caplog.at_level(logging.WARNING, logger="checkpointd"):
            with CheckpointManager(root, _state(1)) as mgr:
                mgr.save(1)
                assert mgr.stats()["codec"] == "zstd"
        assert "writes 'zstd'" in caplog.text and options.NATIVE_ENV in caplog.text
        state = _state(0)
        with CheckpointManager(root, state) as mgr:
            assert mgr.restore_latest() == 1
        expected = _state(1)
        assert all(torch.equal(a, b) for a, b in zip(state["model"].state_dict().values(),
                                                     expected["model"].state_dict().values()))
        assert state["counters"] == {"seen": 1} and torch.equal(state["t"], expected["t"])
    finally:
        planes_native.reset()


def test_two_tiers_commit_native_files_locally_by_default(tmp_path):
    with CheckpointManager(f"memory://checkpointd-tests/{uuid.uuid4().hex}", _state(1), local_dir=tmp_path / "local") as mgr:
        mgr.save(1)
        assert mgr.stats()["codec"] == "none"
