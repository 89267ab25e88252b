"""Both ways the parallel local writer puts bytes in a file (``writemode.WRITE_MODE``): positional
writes and a shared mapping. Same files, same checksums; a full disk is a clean error in both."""

from __future__ import annotations

import os
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from checkpointd.storage import iopool
from checkpointd import CheckpointManager, CheckpointWriteError, IOOptions, load, options
from checkpointd.format.manifest import Manifest
from checkpointd.storage import writemode
from checkpointd.testing import SmallFilesystemUnavailable, small_filesystem

MiB = 2**20


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3), torch.nn.Flatten(), torch.nn.Linear(16 * 30 * 30, 64))
    return m.to(memory_format=torch.channels_last)


@pytest.mark.parametrize("mode", ["pwrite", "mmap"])
def test_modes_write_identical_loadable_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    monkeypatch.setattr(writemode, "WRITE_MODE", mode)
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
    monkeypatch.setattr(writemode, "WRITE_MODE", "mmap")
    try:
        with small_filesystem(3 * MiB, parent=tmp_path) as mount:
            state = {"w": torch.randn(1024 * 1024)}  # 4 MiB: cannot fit
            with CheckpointManager(mount / "run", state, compression=None, io=IOOptions(retry_timeout_secs=1)) as mgr:
                mgr.save(1)
                with pytest.raises(CheckpointWriteError, match="step 1"):
                    mgr.wait()
                assert mgr.steps() == []
    except SmallFilesystemUnavailable as exc:
        if os.environ.get("CI", "").lower() in {"1", "true", "yes"} and os.geteuid() == 0:
            pytest.fail(f"small filesystem unavailable in CI as root: {exc}")
        pytest.skip(str(exc))


def test_auto_mode_maps_files_on_tmpfs_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto`` picks the mapping on tmpfs and positional writes elsewhere; the default is ``pwrite``."""
    from checkpointd.storage import fsinfo

    monkeypatch.setattr(writemode, "WRITE_MODE", None)
    fd = os.open(tmp_path / "default-probe", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        assert writemode.write_mode(fd) == "pwrite"
    finally:
        os.close(fd)
    monkeypatch.setattr(writemode, "WRITE_MODE", "auto")
    shm = Path("/dev/shm")
    if fsinfo.filesystem_type(str(shm)) != "tmpfs":
        pytest.skip("/dev/shm is not a tmpfs here")
    for directory, expected in ((shm, "mmap"), (tmp_path, "mmap" if fsinfo.is_memory_backed(fsinfo.filesystem_type(str(tmp_path))) else "pwrite")):
        fd = os.open(directory / f"ckd-mode-probe-{os.getpid()}", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            assert writemode.write_mode(fd) == expected, directory
        finally:
            os.close(fd)
            os.unlink(directory / f"ckd-mode-probe-{os.getpid()}")
    monkeypatch.setattr(writemode, "WRITE_MODE", "pwrite")
    fd = os.open(shm / f"ckd-mode-probe-{os.getpid()}", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        assert writemode.write_mode(fd) == "pwrite"  # an explicit choice wins
    finally:
        os.close(fd)
        os.unlink(shm / f"ckd-mode-probe-{os.getpid()}")


def test_filesystem_type_reads_mountinfo(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from checkpointd.storage import fsinfo

    lines = [
        "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw",
        "30 22 0:25 / /dev/shm rw,nosuid shared:5 - tmpfs tmpfs rw",
        r"31 22 0:26 / /mnt/with\040space rw shared:6 - tmpfs tmpfs rw",
    ]
    info = tmp_path / "mountinfo"
    info.write_text("\n".join(lines) + "\n")
    real_open = open

    def fake_open(path: Any, *a: Any, **k: Any) -> Any:
        return real_open(info, *a, **k) if path == "/proc/self/mountinfo" else real_open(path, *a, **k)

    fsinfo._mounts.cache_clear()
    monkeypatch.setattr("builtins.open", fake_open)
    monkeypatch.setattr(os.path, "realpath", lambda p: p)
    try:
        assert fsinfo.filesystem_type("/dev/shm/x/y") == "tmpfs"
        assert fsinfo.filesystem_type("/dev/shmother") == "ext4"  # a prefix that is not a path component
        assert fsinfo.filesystem_type("/mnt/with space/ckpt") == "tmpfs"
        assert fsinfo.filesystem_type("/var/tmp") == "ext4"
        assert fsinfo.is_memory_backed("tmpfs") and not fsinfo.is_memory_backed("ext4")
    finally:
        monkeypatch.undo()
        fsinfo._mounts.cache_clear()


def _spy_writes(monkeypatch: pytest.MonkeyPatch) -> tuple[list[bool], list[Any]]:
    """(fast flag of every ptlayout.write_file call, lanes of every run_tasks call)."""
    from checkpointd.storage import ptlayout

    fast: list[bool] = []
    seen_lanes: list[Any] = []
    inner_file, inner_run = ptlayout.write_file, iopool.run_tasks

    def write_file(*a: Any, **k: Any) -> Any:
        fast.append(bool(k.get("fast", False)))
        return inner_file(*a, **k)

    def run_tasks(fns: Any, executor: Any = None, lanes: Any = None) -> Any:
        seen_lanes.append(lanes)
        return inner_run(fns, executor, lanes=lanes)

    monkeypatch.setattr(ptlayout, "write_file", write_file)
    monkeypatch.setattr(ptlayout, "run_tasks", run_tasks)
    return fast, seen_lanes


def _check_step(step_dir: Path, model: torch.nn.Module, step: int) -> None:
    manifest = Manifest.from_json((step_dir / "manifest.json").read_bytes())
    for entry in manifest.files:
        data = (step_dir / entry.path).read_bytes()
        assert f"crc32:{zlib.crc32(data):08x}" == entry.checksum, entry.path
    weights = torch.load(step_dir / f"Sequential.0.{step}.pt", weights_only=True)
    for k, v in model.state_dict().items():
        assert torch.equal(weights[k], v) and weights[k].stride() == v.stride(), k


@pytest.fixture(params=["tmp_path", "dev_shm"])
def write_root(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    """tmp_path (whatever filesystem it is on) and a directory on /dev/shm (tmpfs: the mapped path)."""
    from checkpointd.storage import fsinfo

    if request.param == "tmp_path":
        yield tmp_path
        return
    shm = Path("/dev/shm")
    if fsinfo.filesystem_type(str(shm)) != "tmpfs":
        pytest.skip("/dev/shm is not a tmpfs here")
    root = shm / f"ckd-persist-test-{os.getpid()}"
    yield root
    import shutil

    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("persist", ["gentle", "fast"])
def test_persist_setting_chooses_mode_and_lanes(write_root: Path, monkeypatch: pytest.MonkeyPatch, persist: str) -> None:
    """fast: every I/O thread on each file where the file is mapped (tmpfs); positional writes keep 4.

    The in-process writers (no persist process: with one, every file's bytes go through it)."""
    from checkpointd.storage import fsinfo

    monkeypatch.setenv(options.PERSIST_PROCESS_ENV, "0")
    monkeypatch.setattr(writemode, "WRITE_MODE", None)
    monkeypatch.setattr(writemode, "FAST_PERSIST", persist == "fast")
    monkeypatch.setenv(options.IO_THREADS_ENV, "6")
    fast, lanes = _spy_writes(monkeypatch)
    model = _model()
    with CheckpointManager(write_root, {"model": model}, compression=None) as mgr:
        mgr.save(4)
    assert fast and all(f == (persist == "fast") for f in fast)
    mapped = persist == "fast" and fsinfo.is_memory_backed(fsinfo.filesystem_type(str(write_root)))
    assert (6 if mapped else writemode.write_lanes()) in lanes
    assert (6 in lanes) == mapped
    _check_step(write_root / "step-000000004", model, 4)


def test_a_preemption_save_is_written_fast(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import signal
    import time

    monkeypatch.setattr(writemode, "FAST_PERSIST", False)
    fast, _ = _spy_writes(monkeypatch)
    model = _model()
    with CheckpointManager(tmp_path, {"model": model}, compression=None, every_n_steps=2,
                           save_on_signals=[signal.SIGUSR1]) as mgr:
        assert mgr.maybe_save(2)
        mgr.wait()
        scheduled = list(fast)
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
        assert mgr.maybe_save(3)  # not due: saved because of the signal
        mgr.wait()
    assert scheduled and not any(scheduled)
    assert fast[len(scheduled):] and all(fast[len(scheduled):])
    _check_step(tmp_path / "step-000000003", model, 3)


def test_a_file_system_mounted_after_the_first_lookup_is_recognised(tmp_path: Path) -> None:
    """The mount table is cached: a tmpfs mounted later (a job's checkpoint tmpfs, the disk-full tests')
    must not be taken for its parent's file system (that decides how files are written)."""
    from checkpointd.storage import fsinfo

    parent_type = fsinfo.filesystem_type(str(tmp_path))  # reads and caches the table
    try:
        with small_filesystem(8 * 2**20, parent=tmp_path) as mount:
            assert fsinfo.filesystem_type(str(mount / "ckpt" / "step-000000001")) == "tmpfs"
            assert fsinfo.filesystem_type(str(mount)) == "tmpfs"
        assert fsinfo.filesystem_type(str(tmp_path)) == parent_type
    except SmallFilesystemUnavailable as exc:
        if os.environ.get("CI", "").lower() in {"1", "true", "yes"} and os.geteuid() == 0:
            pytest.fail(f"small filesystem unavailable in CI as root: {exc}")
        pytest.skip(str(exc))
