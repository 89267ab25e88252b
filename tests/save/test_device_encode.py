"""Records encoded on the device (``save.device_encode``), driven here with the encoder's host kernels:
the staged buffers get each record's frames, the persist process writes those frames as they are between
the chunks it encodes itself (zip member CRCs from the native bytes), and a file written without the
persist process gets its records' native bytes back first."""

from __future__ import annotations

import io
import zipfile
import zlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from checkpointd.codecs.compress import decode_bytes, get_codec
from checkpointd.format.serialize import plan_pt
from checkpointd.save import device_encode
from checkpointd.save.arena import StagingArena, tensor_spec
from checkpointd.save.device_copies import PendingCopies
from checkpointd.storage import ptlayout, sharedmem, writemode, ziplayout


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(600, 1000, generator=g) * 0.02,
        "b16": (torch.randn(1 << 20, generator=g) * 0.02).to(torch.bfloat16),
        "f64": torch.randn(300_000, generator=g, dtype=torch.float64),
        "steps": torch.arange(1000),
        "noise": torch.randint(-2**31, 2**31 - 1, (300_000,), dtype=torch.int32, generator=g).view(torch.float32),
    }


def _staged(tensors: dict[str, torch.Tensor]) -> tuple[StagingArena, dict[str, torch.Tensor], SimpleNamespace]:
    """An arena holding ``tensors``' layout, and a job whose snapshot leaves the floats to the encoder."""
    arena = StagingArena([tensor_spec(t) for t in tensors.values()], pin=False)
    staged = dict(zip(tensors, arena.buffers))
    floats = [(t.clone(), staged[k]) for k, t in tensors.items() if t.is_floating_point()]  # (the "clone", host)
    for k, t in tensors.items():
        if not t.is_floating_point():
            staged[k].copy_(t)
    job = SimpleNamespace(staged=SimpleNamespace(copies=PendingCopies(encoded=floats)), encoded={})
    return arena, staged, job


def test_the_staged_buffers_get_the_frames_and_the_clone_is_released() -> None:
    tensors = _tensors()
    _, staged, job = _staged(tensors)
    assert not job.staged.copies.device_reads_done.is_set()
    device_encode.encode_staged(job, get_codec("zstd-planes", chunk_bytes=1 << 20))
    assert job.staged.copies.device_reads_done.is_set()
    assert set(job.encoded) == {staged[k].data_ptr() for k in ("w", "b16", "f64")}  # noise: copied as it is
    assert torch.equal(staged["noise"].view(torch.int32), tensors["noise"].view(torch.int32))
    for k in ("w", "b16", "f64"):
        e = job.encoded[staged[k].data_ptr()]
        native = tensors[k].reshape(-1).view(torch.uint8).numpy()
        assert e.crc == zlib.crc32(native)
        assert sum(n for _, _, n in e.frames) == native.size
        assert e.frames[-1][0] + e.frames[-1][1] < native.size  # the frames are smaller than the tensor
        device_encode.restore_native(job.encoded, [(k, staged[k])])
        assert torch.equal(staged[k].view(torch.uint8), tensors[k].view(torch.uint8)), k
    assert not job.encoded


def test_an_encoder_failure_copies_the_tensors_as_they_are(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise RuntimeError("no kernels")

    monkeypatch.setattr(device_encode.encode_device, "encode_records", refuse)
    tensors = _tensors()
    _, staged, job = _staged(tensors)
    device_encode.encode_staged(job, get_codec("zstd-planes"))
    assert job.encoded == {} and job.staged.copies.device_reads_done.is_set()
    for k, t in tensors.items():
        assert torch.equal(staged[k].view(torch.uint8), t.view(torch.uint8)), k


@pytest.mark.skipif(not sharedmem.supported(), reason="the persist process needs Linux memfd_create")
@pytest.mark.parametrize("mode", ["pwrite", "mmap"])  # mmap: a mapping sized to the frames, not the native bytes
def test_the_persist_process_writes_device_frames_between_its_own_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                         mode: str) -> None:
    monkeypatch.setattr(writemode, "WRITE_MODE", mode)
    tensors = _tensors()
    _, staged, job = _staged(tensors)
    codec = get_codec("zstd-planes", chunk_bytes=1 << 20)
    device_encode.encode_staged(job, codec)
    plan = plan_pt(staged)
    image = ziplayout.pt_image(plan)
    result = ptlayout.write_encoded_file(str(tmp_path / "f.pt.zst"), image, codec.name, codec.level, codec.chunk_bytes,
                                         {}, encoded=job.encoded)
    assert result is not None
    data = (tmp_path / "f.pt.zst").read_bytes()
    assert result.nbytes == len(data) and result.crc == zlib.crc32(data)
    native = bytes(decode_bytes("zstd-planes", data))
    with zipfile.ZipFile(io.BytesIO(native)) as zf:
        assert zf.testzip() is None  # the member CRCs: of the native bytes, computed before the frames
    loaded = torch.load(io.BytesIO(native), weights_only=True)
    for k, t in tensors.items():
        assert torch.equal(loaded[k].view(torch.uint8) if t.is_floating_point() else loaded[k],
                           t.view(torch.uint8) if t.is_floating_point() else t), k
    assert len(data) < 0.9 * len(native)


@pytest.mark.skipif(not sharedmem.supported(), reason="the persist process needs Linux memfd_create")
def test_frames_that_cannot_go_as_frames_are_not_written_as_native_bytes(tmp_path: Path) -> None:
    tensors = _tensors()
    _, staged, job = _staged(tensors)
    codec = get_codec("zstd-planes", chunk_bytes=1 << 20)
    device_encode.encode_staged(job, codec)
    key = next(iter(job.encoded))
    wrong = job.encoded[key]  # an entry whose size is not its record's: its bytes would go as native ones
    job.encoded[key] = device_encode.Encoded(wrong.host[:-16], wrong.frames, wrong.crc)
    image = ziplayout.pt_image(plan_pt(staged))
    assert ptlayout.write_encoded_file(str(tmp_path / "f.pt.zst"), image, codec.name, codec.level, codec.chunk_bytes,
                                       {}, encoded=job.encoded) is None
    assert not (tmp_path / "f.pt.zst").exists()
