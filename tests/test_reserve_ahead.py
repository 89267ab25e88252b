"""Files reserved while the snapshot is taken (``checkpointd.reserve``), on a real tmpfs.

A save to a memory file system creates and reserves (``posix_fallocate``) its large files on the
committer thread while the training thread is still copying the CPU tensors inside ``maybe_save``;
the bytes saved are the snapshot's, a full file system is a clear error that loses nothing, a failure
of the copies is raised once by ``maybe_save``, and files taken from the recycling bin are taken there.
Each test mounts its own small tmpfs (``checkpointd.testing.small_filesystem``: root; skipped
elsewhere, a failure in CI as root).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from checkpointd import CheckpointManager, CheckpointWriteError, fsinfo, persist_process, savejob
from checkpointd.testing import SmallFilesystemUnavailable, small_filesystem

MiB = 2**20
BIG = 20 * MiB
"""Files at least this large are reserved ahead (``reserve.MIN_RESERVE_BYTES`` is 16 MiB)."""


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    try:
        with small_filesystem(256 * MiB, parent=tmp_path) as mount:
            yield mount
    except SmallFilesystemUnavailable as exc:
        if os.environ.get("CI", "").lower() in {"1", "true", "yes"} and os.geteuid() == 0:
            pytest.fail(f"small filesystem unavailable in CI as root: {exc}")
        pytest.skip(str(exc))


@pytest.fixture(autouse=True)
def _no_files_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blank files made ahead would be taken from the bin instead of reserved: the tests that want
    recycling get it from retention."""
    monkeypatch.setenv("CHECKPOINTD_FILES_AHEAD", "0")
    monkeypatch.delenv("CHECKPOINTD_RESERVE_AHEAD", raising=False)


def _model_and_optimizer(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """~25 MB of parameters and as much momentum: a model file and an optimizer file, both reserved."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(2048, 3072, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 2048)).sum().backward()
    opt.step()
    return model, opt


def _large_files(root: Path) -> list[Path]:
    return [p for p in root.glob("step-*/**/*") if p.is_file() and p.stat().st_size >= BIG]


def _reserved(root: Path, count: int, timeout: float) -> bool:
    """Whether ``count`` large files under ``root`` have all their blocks allocated, within ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = _large_files(root)
        if len(files) >= count and all(p.stat().st_blocks * 512 >= p.stat().st_size for p in files):
            return True
        time.sleep(0.01)
    return False


def _fresh_copy(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"w": model.weight.detach().clone(),
            "m": opt.state[model.weight]["momentum_buffer"].clone()}


def _restored_equals(root: Path, expected: dict[str, Any], step: int) -> None:
    model, opt = _model_and_optimizer(seed=99)  # other values: the restore must bring them back
    mgr = CheckpointManager(root, {"model": model, "optim": opt}, compression=None)
    try:
        assert mgr.restore_latest() == step
        assert torch.equal(model.weight.detach(), expected["w"])
        assert torch.equal(opt.state[model.weight]["momentum_buffer"], expected["m"])
    finally:
        mgr.close()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_files_are_reserved_while_the_cpu_copies_are_made(tmpfs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmpfs / "ckpt"
    model, opt = _model_and_optimizer()
    expected = _fresh_copy(model, opt)
    seen: dict[str, bool] = {}
    real_copy = savejob.copy_cpu_pairs

    def copy_once_reserved(pairs: Any) -> None:  # the training thread, inside maybe_save
        seen["reserved_before_copy"] = _reserved(root, count=2, timeout=10.0)
        real_copy(pairs)

    monkeypatch.setattr(savejob, "copy_cpu_pairs", copy_once_reserved)
    mgr = CheckpointManager(root, {"model": model, "optim": opt}, compression=None)
    try:
        mgr.save(1)
        with torch.no_grad():  # maybe_save returned: the snapshot is taken, changes are not saved
            model.weight.add_(1.0)
            opt.state[model.weight]["momentum_buffer"].zero_()
        mgr.wait()
        assert seen == {"reserved_before_copy": True}
        assert mgr.stats()["last_save"]["reserve_secs"] >= 0
    finally:
        mgr.close()
    _restored_equals(root, expected, 1)


def test_turned_off_the_copies_are_made_before_the_job_and_nothing_is_reserved(
        tmpfs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHECKPOINTD_RESERVE_AHEAD", "0")
    root = tmpfs / "ckpt"
    model, opt = _model_and_optimizer()
    expected = _fresh_copy(model, opt)
    called: list[int] = []
    real_copy = savejob.copy_cpu_pairs
    monkeypatch.setattr(savejob, "copy_cpu_pairs", lambda pairs: (called.append(1), real_copy(pairs)))
    mgr = CheckpointManager(root, {"model": model, "optim": opt}, compression=None)
    try:
        mgr.save(1)
        mgr.wait()
        assert called == []  # copied inside the snapshot, as before
        assert "reserve_secs" not in mgr.stats()["last_save"]
    finally:
        mgr.close()
    _restored_equals(root, expected, 1)


def test_a_full_file_system_at_reservation_is_clear_and_loses_nothing(tmpfs: Path) -> None:
    root = tmpfs / "ckpt"
    model, opt = _model_and_optimizer()
    mgr = CheckpointManager(root, {"model": model, "optim": opt}, compression=None, retry_timeout_secs=5)
    try:
        mgr.save(1)
        mgr.wait()
        kept = _fresh_copy(model, opt)
        st = os.statvfs(tmpfs)
        filler = tmpfs / "filler.bin"
        with open(filler, "wb") as f:  # room for one of the two large files, not both
            f.write(b"\0" * (st.f_bavail * st.f_frsize - 40 * MiB))
        fds = _open_fds()
        writer = persist_process.client()
        assert writer is not None and writer.alive
        with torch.no_grad():
            model.weight.add_(1.0)
        mgr.save(2)
        with pytest.raises(CheckpointWriteError, match="No space left|ENOSPC"):
            mgr.wait()
        assert mgr.steps() == [1]
        assert _open_fds() <= fds  # every reserved file's descriptor closed
        # the failed reservation was raised here, not skipped: the persist process never copied into
        # pages that do not exist (that is a SIGBUS, which kills it)
        assert persist_process.client() is writer and writer.alive and writer.proc.poll() is None
        filler.unlink()
        mgr.save(3)
        mgr.wait()
        assert mgr.steps() == [1, 3]
        expected = _fresh_copy(model, opt)
    finally:
        mgr.close()
    assert not torch.equal(kept["w"], expected["w"])
    _restored_equals(root, expected, 3)


def test_a_failed_cpu_copy_is_raised_once_and_its_reserved_files_go(tmpfs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmpfs / "ckpt"
    model, opt = _model_and_optimizer()
    real_copy = savejob.copy_cpu_pairs
    failures: list[BaseException] = []

    def copy_or_fail(pairs: Any) -> None:
        if failures:
            _reserved(root, count=2, timeout=10.0)  # fail once the files exist: they must go again
            raise failures.pop()
        real_copy(pairs)

    monkeypatch.setattr(savejob, "copy_cpu_pairs", copy_or_fail)
    mgr = CheckpointManager(root, {"model": model, "optim": opt}, compression=None)
    try:
        mgr.save(1)  # succeeds after the failure below: the persist process and its slabs exist from here on
        mgr.wait()
        failures.append(RuntimeError("boom: the copy failed"))
        fds = _open_fds()
        with pytest.raises(RuntimeError, match="boom"):
            mgr.save(2)
        mgr.wait()  # the abandoned save is not raised a second time
        assert mgr.stats()["saves_failed"] == 1
        assert [p for p in _large_files(root) if "step-" in p.parent.name and p.parent.name.endswith("2")] == []
        assert _open_fds() <= fds
        mgr.save(3)
        mgr.wait()
        assert mgr.steps() == [1, 3]
        expected = _fresh_copy(model, opt)
    finally:
        mgr.close()
    _restored_equals(root, expected, 3)


def test_retired_files_are_taken_at_reservation(tmpfs: Path) -> None:
    root = tmpfs / "ckpt"
    model, opt = _model_and_optimizer()
    mgr = CheckpointManager(root, {"model": model, "optim": opt}, compression=None, keep_last=1)
    try:
        for step in (1, 2, 3):
            with torch.no_grad():
                model.weight.add_(1.0)
            mgr.save(step)
            mgr.wait()
        last = mgr.stats()["last_save"]
        assert last["files_recycled"] == 2  # step 3 wrote over the files retention retired from step 1
        assert "reserve_secs" in last
        expected = _fresh_copy(model, opt)
    finally:
        mgr.close()
    _restored_equals(root, expected, 3)


def test_a_file_system_mounted_after_the_first_lookup_is_recognised(tmp_path: Path) -> None:
    """The mount table is cached: a tmpfs mounted later (a job's checkpoint tmpfs, these tests') must
    not be taken for its parent's file system (it decides the write mode and the reservation)."""
    parent_type = fsinfo.filesystem_type(str(tmp_path))  # reads and caches the table
    try:
        with small_filesystem(8 * MiB, parent=tmp_path) as mount:
            assert fsinfo.filesystem_type(str(mount / "ckpt")) == "tmpfs"
            if parent_type != "tmpfs":
                assert fsinfo.filesystem_type(str(tmp_path)) == parent_type
    except SmallFilesystemUnavailable as exc:
        if os.environ.get("CI", "").lower() in {"1", "true", "yes"} and os.geteuid() == 0:
            pytest.fail(f"small filesystem unavailable in CI as root: {exc}")
        pytest.skip(str(exc))
