"""Compressed local files encoded by the persist process (``ptlayout.write_encoded_file``): exact, checksummed
as the manifest says, with zip member CRCs right, without torch in that process, and written here when it fails."""

from __future__ import annotations

import io
import os
import zipfile
import zlib
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

from checkpointd import CheckpointManager, load
from checkpointd.codecs.compress import decode_bytes
from checkpointd.errors import CheckpointWriteError
from checkpointd.format.manifest import Manifest
from checkpointd.storage import persist_process, sharedmem, writemode

pytestmark = pytest.mark.skipif(not sharedmem.supported(), reason="shared staging needs Linux memfd_create")


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 384), torch.nn.Linear(384, 200).to(torch.bfloat16))
    opt = torch.optim.AdamW(model[0].parameters())
    model[0](torch.randn(4, 512)).square().mean().backward()
    opt.step()
    return {"model": model, "optimizer": opt}


def _check_step(root: Path, step: int, state: dict[str, Any], codec: str) -> None:
    step_dir = root / f"step-{step:09d}"
    manifest = Manifest.from_json((step_dir / "manifest.json").read_bytes())
    assert {e.codec for e in manifest.files} == {codec}
    for entry in manifest.files:
        data = (step_dir / entry.path).read_bytes()
        assert len(data) == entry.size and f"crc32:{zlib.crc32(data):08x}" == entry.checksum, entry.path
        native = bytes(decode_bytes(codec, data))
        assert len(native) == entry.raw_size
        with zipfile.ZipFile(io.BytesIO(native)) as zf:
            assert zf.testzip() is None, f"{entry.path}: a member's CRC-32 differs from its header's"
    restored = load(root, step=step)
    for k, v in state["model"].state_dict().items():
        assert torch.equal(restored["model"][k], v), k
    for k, v in state["optimizer"].state_dict()["state"][0].items():
        assert torch.equal(restored["optimizer"]["state"][0][k], v), k


@pytest.mark.parametrize("mode", ["pwrite", "mmap"])
@pytest.mark.parametrize("codec", ["zstd-planes", "zstd"])
def test_compressed_files_are_encoded_by_the_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, codec: str,
                                                      mode: str) -> None:
    monkeypatch.setattr(writemode, "WRITE_MODE", mode)  # (by default: a mapping on memory file systems only)
    state = _state()
    with CheckpointManager(tmp_path, state, compression=codec) as mgr:
        mgr.save(1)
        mgr.wait()
        process = persist_process.client()
        assert process is not None and process.alive
        before = process.writes_done
        mgr.save(2)
        mgr.wait()
        assert process.writes_done == before + 2  # one encode request for each of the two files
    _check_step(tmp_path, 1, state, codec)
    _check_step(tmp_path, 2, state, codec)


def test_the_process_encodes_without_torch(tmp_path: Path) -> None:
    state = _state()
    with CheckpointManager(tmp_path, state, compression="zstd-planes") as mgr:
        mgr.save(1)
        mgr.wait()
        process = persist_process.client()
        assert process is not None
        maps = Path(f"/proc/{process.proc.pid}/maps").read_text()
    assert "zstandard" in maps  # it encoded: the codec library is loaded there ...
    assert "libtorch" not in maps  # ... and torch's are not


@pytest.mark.parametrize("refused", ["submit_encode", "submit_crc"])
def test_a_refused_request_is_encoded_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           caplog: pytest.LogCaptureFixture, refused: str) -> None:
    def refuse(self: Any, *args: Any, **kwargs: Any) -> Future[Any]:
        failed: Future[Any] = Future()
        failed.set_exception(persist_process.PersistProcessError("persist process: refused for the test"))
        return failed

    monkeypatch.setattr(persist_process.PersistProcess, refused, refuse)
    state = _state()
    with CheckpointManager(tmp_path, state, compression="zstd-planes") as mgr:
        mgr.save(3)
    _check_step(tmp_path, 3, state, "zstd-planes")
    assert "refused for the test" in caplog.text
    assert sorted(p.name for p in (tmp_path / "step-000000003").iterdir() if p.name.endswith(".partial")) == []


def test_an_encode_failure_fails_the_save_and_commits_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full_disk(self: Any, *args: Any, **kwargs: Any) -> Future[Any]:
        failed: Future[Any] = Future()
        failed.set_exception(OSError(28, "persist process: No space left on device"))
        return failed

    state = _state()
    with CheckpointManager(tmp_path, state, compression="zstd-planes") as mgr:
        mgr.save(1)
        mgr.wait()
        monkeypatch.setattr(persist_process.PersistProcess, "submit_encode", full_disk)
        mgr.save(2)
        with pytest.raises(CheckpointWriteError, match="No space left"):
            mgr.wait()
        assert mgr.latest_step() == 1
    assert not (tmp_path / "step-000000002" / "COMMITTED").exists()
    _check_step(tmp_path, 1, state, "zstd-planes")


@pytest.mark.parametrize("mode", ["pwrite", "mmap"])
def test_one_file_encoded_again_and_again_holds_exactly_the_last_encoding(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                           mode: str) -> None:
    """A recycled file is encoded into again: after a bigger file and after a smaller one (in ``mmap`` mode
    the process keeps a mapping sized to the first file's bound), it is cut to exactly its new encoding."""
    monkeypatch.setattr(writemode, "WRITE_MODE", mode)
    process = persist_process.client()
    assert process is not None
    path = tmp_path / "again.pt.zst"
    for i, count in enumerate((700_000, 50_000, 1_200_000)):
        raw = (torch.randn(count, generator=torch.Generator().manual_seed(i)) * 0.02).numpy().tobytes()
        pieces = [(0, b"PK-header", 0), (0, raw, 4), (0, b"end", 0)]
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            size, crc, native = process.submit_encode(fd, "zstd-planes", 1, 1 << 20, pieces, []).result(timeout=60)
        finally:
            os.close(fd)
        data = path.read_bytes()
        assert (len(data), f"{zlib.crc32(data):08x}", native) == (size, f"{crc:08x}", len(raw) + 12)
        assert bytes(decode_bytes("zstd-planes", data)) == b"PK-header" + raw + b"end"
    assert process.alive
