"""Early writeback: on a disk, each range of a checkpoint file is handed to the disk as soon as it is
written (``sync_file_range``), by the in-process writer and by the persist process; memory file systems
are left alone; files come out the same either way."""

from __future__ import annotations

import os
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from checkpointd import options
from checkpointd.storage import ziplayout
from checkpointd import CheckpointManager, StagingOptions
from checkpointd.storage import fsinfo
from checkpointd.storage import persist_process
from checkpointd.storage import ptlayout
from checkpointd.storage import sharedmem
from checkpointd.format.manifest import Manifest
from checkpointd.format.serialize import plan_pt
from persist_requests import record_requests


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    return {f"t{i}": torch.randn(300_000 + 1000 * i) for i in range(4)}


@pytest.mark.parametrize(("setting", "fstype", "expected"), [
    (None, "ext4", True), (None, "xfs", True), (None, "tmpfs", False), (None, None, False),
    (True, "tmpfs", True), (False, "ext4", False), (False, "xfs", False),
])
def test_early_writeback_follows_the_filesystem_and_the_switch(monkeypatch: pytest.MonkeyPatch, setting: bool | None,
                                                               fstype: str | None, expected: bool) -> None:
    monkeypatch.setattr(fsinfo, "EARLY_WRITEBACK", setting)
    monkeypatch.setattr(fsinfo, "fd_filesystem_type", lambda fd: fstype)
    assert fsinfo.early_writeback(0) is expected


def test_start_writeback_on_a_file_and_on_a_pipe(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(1 << 20))
    fd = os.open(path, os.O_RDWR)
    try:
        assert fsinfo.start_writeback(fd, 0, 1 << 20) is True
    finally:
        os.close(fd)
    r, w = os.pipe()
    try:
        assert fsinfo.start_writeback(w, 0, 4096) is False  # ESPIPE: not supported, not an error
    finally:
        os.close(r)
        os.close(w)
    with pytest.raises(OSError):
        fsinfo.start_writeback(987_654, 0, 4096)  # EBADF is a real failure


def _record_writebacks(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Early writeback forced on; every ``(offset, nbytes)`` handed to the disk in this process is recorded."""
    monkeypatch.setattr(fsinfo, "EARLY_WRITEBACK", True)
    calls: list[tuple[int, int]] = []
    real = fsinfo.start_writeback

    def spy(fd: int, offset: int, nbytes: int) -> bool:
        calls.append((offset, nbytes))
        return real(fd, offset, nbytes)

    monkeypatch.setattr(fsinfo, "start_writeback", spy)
    return calls


def test_in_process_writer_hands_every_data_range_to_the_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _record_writebacks(monkeypatch)
    state = _state()
    path = str(tmp_path / "w.pt")
    image = ziplayout.pt_image(plan_pt(state))
    result = ptlayout.write_file(path, image, chunk_bytes=256 << 10)  # plain CPU tensors: written in-process
    data = Path(path).read_bytes()
    assert result.crc == zlib.crc32(data) and result.nbytes == len(data)
    loaded = torch.load(path, weights_only=True)
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    # every byte of every member was in some started range (headers and the pickle included)
    covered = bytearray(len(data))
    for offset, n in calls:
        covered[offset:offset + n] = b"\1" * n
    tensor_bytes = sum(v.numel() * v.element_size() for v in state.values())
    assert sum(covered) >= tensor_bytes
    assert len(calls) >= tensor_bytes // (256 << 10)  # range by range, not once at the end


def test_no_writeback_requested_on_memory_filesystems(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fsinfo, "EARLY_WRITEBACK", None)
    monkeypatch.setattr(fsinfo, "fd_filesystem_type", lambda fd: "tmpfs")
    calls: list[Any] = []
    monkeypatch.setattr(fsinfo, "start_writeback", lambda *a: calls.append(a) or True)
    ptlayout.write_file(str(tmp_path / "m.pt"), ziplayout.pt_image(plan_pt(_state())), chunk_bytes=256 << 10)
    assert calls == []


@pytest.mark.skipif(not sharedmem.supported(), reason="the persist process needs Linux memfd_create")
@pytest.mark.parametrize("setting", [True, False])
def test_persist_process_is_asked_to_write_back_and_writes_the_same_bytes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setting: bool) -> None:
    monkeypatch.setattr(fsinfo, "EARLY_WRITEBACK", setting)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 256))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 512)).sum().backward()
    opt.step()
    with CheckpointManager(tmp_path, {"model": model, "optimizer": opt}, compression=None) as mgr:
        mgr.save(1)
        mgr.wait()
        requests = record_requests(monkeypatch, "write")
        process = persist_process.client()
        before = process.writes_done
        mgr.save(2)
        mgr.wait()
        assert process.writes_done >= before + 2
    assert requests and all(m[-1] is setting for m in requests)
    step_dir = tmp_path / "step-000000002"
    manifest = Manifest.from_json((step_dir / "manifest.json").read_bytes())
    for entry in manifest.files:
        data = (step_dir / entry.path).read_bytes()
        assert f"crc32:{zlib.crc32(data):08x}" == entry.checksum, entry.path
    weights = torch.load(step_dir / "Sequential.0.2.pt", weights_only=True)
    for k, v in model.state_dict().items():
        assert torch.equal(weights[k], v), k


@pytest.mark.parametrize("writer", ["persist-process", "in-process"])
def test_host_budget_stream_hands_its_ranges_to_the_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         writer: str) -> None:
    """Under a host staging budget the records arrive chunk by chunk (``chunkstream``): those ranges too,
    whether the persist process writes the chunks (asked to, on attaching the file) or this process does."""
    from checkpointd.save import snapshot

    if writer == "persist-process" and not sharedmem.supported():
        pytest.skip("the persist process needs Linux memfd_create")
    if writer == "in-process":
        monkeypatch.setenv(options.PERSIST_PROCESS_ENV, "0")
    device = "cuda" if torch.cuda.is_available() else "cpu"  # with CUDA only device tensors are streamed
    if device == "cpu":
        monkeypatch.setattr(snapshot, "STREAM_CPU_TENSORS", True)  # CPU tensors through the chunk ring, as CUDA's
    calls = _record_writebacks(monkeypatch)
    requests = record_requests(monkeypatch, "attach", "put") if writer == "persist-process" else []
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 512)).to(device)
    with CheckpointManager(tmp_path, {"model": model}, compression=None,
                           staging=StagingOptions(host_budget_bytes=2 << 20)) as mgr:
        mgr.save(1)
        mgr.wait()
        assert mgr.stats()["saves_committed"] == 1
    weights = torch.load(tmp_path / "step-000000001" / "Sequential.0.1.pt", weights_only=True)
    for k, v in model.state_dict().items():
        assert torch.equal(weights[k], v.cpu()), k
    tensor_bytes = sum(v.numel() * v.element_size() for v in model.state_dict().values())
    if writer == "in-process":
        assert sum(n for _, n in calls) >= tensor_bytes  # every streamed byte was in a started range
        return
    attached = [m for m in requests if m[0] == "attach"]
    puts = [m for m in requests if m[0] == "put"]
    assert attached and all(m[4] is True for m in attached)  # ("attach", id, end, mode, writeback)
    assert {m[2] for m in puts} <= {m[1] for m in attached}
    assert sum(n for m in puts for task in m[4] for _, _, _, n in task) >= tensor_bytes
    assert sum(n for _, n in calls) < tensor_bytes  # here only the headers and the pickle
