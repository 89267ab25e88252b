"""Both ways the parallel local writer puts bytes in a file (``CHECKPOINTD_WRITE_MODE``): positional
writes and a shared mapping. Same files, same checksums; a full disk is a clean error in both."""

from __future__ import annotations

import os
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from checkpointd import CheckpointManager, CheckpointWriteError, load
from checkpointd.manifest import Manifest
from checkpointd.testing import SmallFilesystemUnavailable, small_filesystem

MiB = 2**20


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3), torch.nn.Flatten(), torch.nn.Linear(16 * 30 * 30, 64))
    return m.to(memory_format=torch.channels_last)


@pytest.mark.parametrize("mode", ["pwrite", "mmap"])
def test_modes_write_identical_loadable_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    monkeypatch.setenv("CHECKPOINTD_WRITE_MODE", mode)
    model = _model()
    with CheckpointManager(tmp_path, {"model": model}, compression=None) as mgr:
        mgr.save(3)
    step_dir = tmp_path / "step-000000003"
    manifest = Manifest.from_json((step_dir / "manifest.json").read_bytes())
    for entry in manifest.files:
        data = (step_dir / entry.path).read_bytes()
        assert len(data) == entry.size
        assert f"crc32:{zlib.crc32(data):08x}" == entry.checksum, entry.path
    weights = torch.load(step_dir / "Sequential.0.3.pt", weights_only=True)
    for k, v in model.state_dict().items():
        assert torch.equal(weights[k], v) and weights[k].stride() == v.stride(), k
    assert torch.equal(load(tmp_path)["model"]["2.weight"], model[2].weight)


def test_mmap_mode_disk_full_is_a_clean_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHECKPOINTD_WRITE_MODE", "mmap")
    try:
        with small_filesystem(3 * MiB, parent=tmp_path) as mount:
            state = {"w": torch.randn(1024 * 1024)}  # 4 MiB: cannot fit
            with CheckpointManager(mount / "run", state, compression=None, retry_timeout_secs=1) as mgr:
                mgr.save(1)
                with pytest.raises(CheckpointWriteError, match="step 1"):
                    mgr.wait()
                assert mgr.steps() == []
    except SmallFilesystemUnavailable as exc:
        if os.environ.get("CI", "").lower() in {"1", "true", "yes"} and os.geteuid() == 0:
            pytest.fail(f"small filesystem unavailable in CI as root: {exc}")
        pytest.skip(str(exc))
