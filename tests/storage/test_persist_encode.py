"""Compressed local files encoded by the persist process (``ptlayout.write_encoded_file``): exact, checksummed
as the manifest says, with zip member CRCs right, without torch in that process, and written here when it fails."""

from __future__ import annotations

import io
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
from checkpointd.storage import persist_process, sharedmem

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


@pytest.mark.parametrize("codec", ["zstd-planes", "zstd"])
def test_compressed_files_are_encoded_by_the_process(tmp_path: Path, codec: str) -> None:
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
