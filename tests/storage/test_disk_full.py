"""Disk full on a real small filesystem (a tmpfs of a few MB, ``checkpointd.testing.small_filesystem``;
needs root, skipped elsewhere): a save that does not fit raises a clear ENOSPC ``CheckpointWriteError``,
commits nothing, leaves the older checkpoints intact and restorable, and the next save succeeds once
space is freed."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from checkpointd import CheckpointManager, CheckpointWriteError, IOOptions
from checkpointd.testing import SmallFilesystemUnavailable, small_filesystem

MiB = 2**20


@pytest.fixture
def small_fs(tmp_path) -> Any:
    try:
        with small_filesystem(6 * MiB, parent=tmp_path) as mount:
            yield mount
    except SmallFilesystemUnavailable as exc:
        if os.environ.get("CI", "").lower() in {"1", "true", "yes"} and os.geteuid() == 0:
            pytest.fail(f"small filesystem unavailable in CI as root: {exc}")
        pytest.skip(str(exc))


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(256 * 1024, generator=g), "meta": {"step": step}}  # 1 MiB, incompressible


def _assign(state: dict[str, Any], step: int) -> None:
    """In place: the manager holds the registered objects, not the mapping."""
    new = _state(step)
    state["w"].copy_(new["w"])
    state["meta"].update(new["meta"])


def _fill(mount: Path, leave_free: int) -> Path:
    """A filler file that leaves about ``leave_free`` bytes free."""
    st = os.statvfs(mount)
    free = st.f_bavail * st.f_frsize
    filler = mount / "filler.bin"
    with open(filler, "wb") as f:
        f.write(b"\0" * max(0, free - leave_free))
    return filler


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_disk_full_is_clear_commits_nothing_and_recovers(small_fs, compression):
    root = small_fs / "ckpt"
    state = _state(1)
    mgr = CheckpointManager(root, state, keep_last=2, compression=compression, io=IOOptions(retry_timeout_secs=30))
    mgr.save(1)
    mgr.wait()
    filler = _fill(small_fs, leave_free=300 * 1024)  # step 2 (1 MiB) does not fit
    _assign(state, 2)
    mgr.save(2)
    with pytest.raises(CheckpointWriteError, match=r"(?s)step 2.*No space left on device.*free space") as info:
        mgr.wait()
    assert info.value.step == 2
    assert mgr.steps() == [1]
    assert not (root / "step-000000002" / "COMMITTED").exists()
    # the older checkpoint is intact and restorable (while the disk is still full)
    live = _state(0)
    with CheckpointManager(root, live) as check:
        assert check.restore_latest() == 1
    assert torch.equal(live["w"], _state(1)["w"]) and live["meta"] == {"step": 1}
    # space is back: the next save commits and the leftover of step 2 is cleaned up
    filler.unlink()
    _assign(state, 3)
    mgr.save(3)
    mgr.wait()
    assert mgr.steps() == [1, 3]
    assert not (root / "step-000000002").exists()
    mgr.close()
    live = _state(0)
    with CheckpointManager(root, live) as check:
        assert check.restore_latest() == 3
    assert torch.equal(live["w"], _state(3)["w"])


def test_disk_full_at_the_marker_commits_nothing(small_fs):
    """Space runs out after the data files: the manifest or marker write fails, nothing is committed."""
    root = small_fs / "ckpt"
    state = _state(1)
    with CheckpointManager(root, state, keep_last=None, compression=None) as mgr:
        mgr.save(1)
        mgr.wait()
        # leave room for the data file (1 MiB + pickle) but not much more
        data_bytes = sum(p.stat().st_size for p in (root / "step-000000001").iterdir() if p.name.endswith(".pt"))
        filler = _fill(small_fs, leave_free=data_bytes + 2048)
        for step in (2, 3):  # whichever write hits the wall, nothing may be committed
            _assign(state, step)
            mgr.save(step)
            with pytest.raises(CheckpointWriteError, match="No space left on device"):
                mgr.wait()
        assert mgr.steps() == [1]
        filler.unlink()
        mgr.save(4)
        mgr.wait()
        assert mgr.steps() == [1, 4]
