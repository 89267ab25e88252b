"""Reserving a mapped file range by range beside the copies (``persist_process_main._Reserver``), on a
real tmpfs, and the mount table seeing a file system mounted after its first read.

The persist process reserves a new tmpfs file (``posix_fallocate``) in ranges while its copies run
behind the reservation front: the bytes land exactly, a full file system is a clear ENOSPC that never
reaches a copy (a copy into an unreserved page is a SIGBUS that kills the process), and turning it off
(``CHECKPOINTD_RESERVE_PIPELINE=0``) reserves the whole file first. Each test mounts its own small
tmpfs (``checkpointd.testing.small_filesystem``: root; skipped elsewhere, a failure in CI as root).
"""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from checkpointd import CheckpointManager, CheckpointWriteError, fsinfo, persist_process, persist_process_main
from checkpointd.testing import SmallFilesystemUnavailable, small_filesystem
from persist_requests import record_requests

MiB = 2**20


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
    """Blank files made ahead would be written over (reserved already): these tests want new files."""
    monkeypatch.setenv("CHECKPOINTD_FILES_AHEAD", "0")
    monkeypatch.delenv("CHECKPOINTD_RESERVE_PIPELINE", raising=False)


def _allocated(path: Path) -> int:
    return os.stat(path).st_blocks * 512


def test_copies_wait_for_their_range_and_the_front_moves_in_ranges(tmpfs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmpfs / "f.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    os.ftruncate(fd, 8 * MiB)
    calls: list[tuple[int, int]] = []
    gate = threading.Event()
    real = os.posix_fallocate

    def fallocate(fd_: int, offset: int, length: int) -> None:
        calls.append((offset, length))
        if offset >= 3 * MiB:
            gate.wait(10)  # hold the front at 3 MiB
        real(fd_, offset, length)

    monkeypatch.setattr(persist_process_main.os, "posix_fallocate", fallocate)
    try:
        reserver = persist_process_main._Reserver(fd, 8 * MiB, range_bytes=MiB)
        reserver.wait_for(3 * MiB)  # returns: those ranges are reserved
        assert _allocated(path) >= 3 * MiB
        waited = threading.Event()
        threading.Thread(target=lambda: (reserver.wait_for(5 * MiB), waited.set()), daemon=True).start()
        time.sleep(0.2)
        assert not waited.is_set()  # a copy beyond the front waits
        gate.set()
        assert waited.wait(10)
        reserver.finish()
        assert calls == [(k * MiB, MiB) for k in range(8)]
        assert _allocated(path) >= 8 * MiB
    finally:
        gate.set()
        os.close(fd)


def test_a_full_file_system_stops_the_front_and_fails_the_copies_beyond_it(tmp_path: Path) -> None:
    try:
        cm = small_filesystem(4 * MiB, parent=tmp_path)
        mount = cm.__enter__()
    except SmallFilesystemUnavailable as exc:
        if os.environ.get("CI", "").lower() in {"1", "true", "yes"} and os.geteuid() == 0:
            pytest.fail(f"small filesystem unavailable in CI as root: {exc}")
        pytest.skip(str(exc))
    try:
        fd = os.open(mount / "f.bin", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            os.ftruncate(fd, 16 * MiB)
            reserver = persist_process_main._Reserver(fd, 16 * MiB, range_bytes=MiB)
            reserver.wait_for(2 * MiB)  # within the space: reserved
            with pytest.raises(OSError) as info:
                reserver.wait_for(16 * MiB)
            assert info.value.errno == errno.ENOSPC
            with pytest.raises(OSError):
                reserver.finish()
            assert reserver.reserved_to < 16 * MiB
        finally:
            os.close(fd)
    finally:
        cm.__exit__(None, None, None)


def _model_and_optimizer(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """~25 MB of parameters and as much momentum: a model file and an optimizer file of several ranges."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(2048, 3072, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 2048)).sum().backward()
    opt.step()
    return model, opt


def _copy_of(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"w": model.weight.detach().clone(), "m": opt.state[model.weight]["momentum_buffer"].clone()}


def _restored_equals(root: Path, expected: dict[str, Any], step: int) -> None:
    model, opt = _model_and_optimizer(seed=99)  # other values: the restore must bring them back
    mgr = CheckpointManager(root, {"model": model, "optim": opt}, compression=None)
    try:
        assert mgr.restore_latest() == step
        assert torch.equal(model.weight.detach(), expected["w"])
        assert torch.equal(opt.state[model.weight]["momentum_buffer"], expected["m"])
    finally:
        mgr.close()


@pytest.mark.parametrize("pipelined", ["1", "0"])
def test_saves_reserve_range_by_range_and_write_the_exact_bytes(
        tmpfs: Path, monkeypatch: pytest.MonkeyPatch, pipelined: str) -> None:
    monkeypatch.setenv("CHECKPOINTD_RESERVE_PIPELINE", pipelined)
    root = tmpfs / "ckpt"
    model, opt = _model_and_optimizer()
    mgr = CheckpointManager(root, {"model": model, "optim": opt}, compression=None)
    try:
        mgr.save(1)
        mgr.wait()
        requests = record_requests(monkeypatch, "write")
        with torch.no_grad():
            model.weight.add_(1.0)
        expected = _copy_of(model, opt)
        mgr.save(2)
        mgr.wait()
    finally:
        mgr.close()
    writes = [m for m in requests if m[2] >= 16 * MiB]  # the two large files
    assert len(writes) == 2 and all(m[3] == "mmap" and m[7] is (pipelined == "1") for m in writes)
    _restored_equals(root, expected, 2)


def test_a_full_file_system_is_clear_and_the_persist_process_lives(tmpfs: Path) -> None:
    root = tmpfs / "ckpt"
    model, opt = _model_and_optimizer()
    mgr = CheckpointManager(root, {"model": model, "optim": opt}, compression=None, retry_timeout_secs=5)
    try:
        mgr.save(1)
        mgr.wait()
        writer = persist_process.client()
        assert writer is not None and writer.alive
        st = os.statvfs(tmpfs)
        filler = tmpfs / "filler.bin"
        with open(filler, "wb") as f:  # room for one of the two large files, not both
            f.write(b"\0" * (st.f_bavail * st.f_frsize - 40 * MiB))
        with torch.no_grad():
            model.weight.add_(1.0)
        mgr.save(2)
        with pytest.raises(CheckpointWriteError, match="No space left|ENOSPC"):
            mgr.wait()
        assert mgr.steps() == [1]
        # no copy ran into a page that was not reserved (a SIGBUS there kills the process)
        assert persist_process.client() is writer and writer.alive and writer.proc.poll() is None
        filler.unlink()
        mgr.save(3)
        mgr.wait()
        assert mgr.steps() == [1, 3]
        expected = _copy_of(model, opt)
    finally:
        mgr.close()
    _restored_equals(root, expected, 3)


def test_a_file_system_mounted_after_the_first_lookup_is_recognised(tmp_path: Path) -> None:
    """The mount table is cached: a tmpfs mounted later (a job's checkpoint tmpfs, these tests') must
    not be taken for its parent's file system (that decides how files are written)."""
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
