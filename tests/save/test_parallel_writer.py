"""Parallel positional ``.pt``/``.mdlus`` writer (``ptlayout``) and CRC-32 combination (``crc``)."""

from __future__ import annotations

import io
import os
import random
import zipfile
import zlib

import pytest
import torch

from checkpointd.save import job as save_job
from checkpointd.storage import ziplayout
from checkpointd import CheckpointManager
from checkpointd.codecs import crc
from checkpointd.storage import ptlayout
from checkpointd.save import writer
from checkpointd.codecs.compress import get_codec
from checkpointd.format.serialize import plan_pt
from checkpointd.storage.store import Store


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(300, 257, generator=g),
        "big": torch.randn(600_000, generator=g),  # > the small chunk size used below
        "i": torch.arange(10, dtype=torch.int64),
        "bf": torch.randn(33, generator=g).to(torch.bfloat16),
        "empty": torch.zeros(0),
        "nested": [torch.ones(3, dtype=torch.uint8), {"s": 5, "t": "x"}],
    }


def _assert_same(a: dict, b: dict) -> None:
    for k in ("w", "big", "i", "bf", "empty"):
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k])
    assert torch.equal(a["nested"][0], b["nested"][0]) and a["nested"][1] == b["nested"][1]


@pytest.mark.parametrize("seed", range(5))
def test_crc32_combine_matches_zlib_on_random_splits(seed: int) -> None:
    rng = random.Random(seed)
    data = os.urandom(rng.randint(1, 200_000))
    cuts = sorted(rng.randint(0, len(data)) for _ in range(rng.randint(1, 6)))
    bounds = [0, *cuts, len(data)]
    parts = [data[a:b] for a, b in zip(bounds, bounds[1:])]
    pieces = [(zlib.crc32(p), len(p)) for p in parts]
    assert crc.crc32_concat(pieces) == zlib.crc32(data)
    acc = 0
    for c, n in pieces:
        acc = crc.crc32_combine_py(acc, c, n)
    assert acc == zlib.crc32(data)
    assert crc.crc32(data) == zlib.crc32(data)


@pytest.mark.parametrize("zip64_limit", [ziplayout.ZIP64_LIMIT, 4096, 16])
def test_pt_loads_with_torch_and_zipfile(tmp_path, zip64_limit: int) -> None:
    obj = _state()
    path = str(tmp_path / "x.pt")
    result = ptlayout.write_file(path, ziplayout.pt_image(plan_pt(obj), zip64_limit=zip64_limit), chunk_bytes=256 << 10)
    data = open(path, "rb").read()
    assert result.nbytes == len(data) and result.crc == zlib.crc32(data)
    with zipfile.ZipFile(path) as zf:
        assert zf.testzip() is None  # every member's CRC and size
        assert zf.namelist()[0] == "archive/data.pkl"
    _assert_same(obj, torch.load(path, weights_only=True))
    _assert_same(obj, torch.load(path, weights_only=True, mmap=True))
    _assert_same(obj, torch.load(io.BytesIO(data), weights_only=True))


def test_large_records_are_aligned(tmp_path) -> None:
    obj = _state()
    img = ziplayout.pt_image(plan_pt(obj))
    for m in img.members:
        if m.size >= ziplayout.LARGE_RECORD_BYTES:
            assert m.data_offset % ziplayout.LARGE_ALIGN == 0
        elif m.name.startswith(b"archive/data/"):
            assert m.data_offset % ziplayout.SMALL_ALIGN == 0


@pytest.mark.parametrize("zip64_limit", [ziplayout.ZIP64_LIMIT, 64])
def test_mdlus_nested_image(tmp_path, zip64_limit: int) -> None:
    from checkpointd.format.mdlus import load_mdlus_state_dict

    obj = {"a.weight": torch.randn(70_000), "a.bias": torch.randn(7)}
    path = str(tmp_path / "m.mdlus")
    members = {"args.json": b'{"__name__": "M"}', "metadata.json": b"{}"}
    result = ptlayout.write_file(path, ziplayout.mdlus_image(members, plan_pt(obj), zip64_limit=zip64_limit),
                                 chunk_bytes=64 << 10)
    data = open(path, "rb").read()
    assert result.crc == zlib.crc32(data)
    with zipfile.ZipFile(path) as zf:
        assert zf.testzip() is None
        assert zf.namelist() == ["args.json", "metadata.json", "model.pt"]
        inner = zf.read("model.pt")
    with zipfile.ZipFile(io.BytesIO(inner)) as zf:
        assert zf.testzip() is None
    back = load_mdlus_state_dict(io.BytesIO(data))
    assert all(torch.equal(back[k], obj[k]) for k in obj)


def test_write_one_file_checksum_is_file_crc(tmp_path) -> None:
    store = Store(str(tmp_path))
    job = save_job.FileJob("f.pt", "pt", plan_pt(_state()), {})
    assert writer.parallel_write_applies(store, get_codec("none"), job)
    entry = writer.write_one_file(store, get_codec("none"), "step-1", job)
    data = (tmp_path / "step-1" / "f.pt").read_bytes()
    assert entry.size == len(data) == entry.raw_size
    assert entry.checksum == f"crc32:{zlib.crc32(data):08x}"
    _assert_same(_state(), torch.load(io.BytesIO(data), weights_only=True))


def test_streaming_and_parallel_files_hold_the_same_content(tmp_path, monkeypatch) -> None:
    store = Store(str(tmp_path))
    none = get_codec("none")
    par = writer.write_one_file(store, none, "a", save_job.FileJob("f.pt", "pt", plan_pt(_state()), {}))
    monkeypatch.setattr(writer, "parallel_write_applies", lambda *a: False)  # the streaming writer (codecs, object stores)
    job = save_job.FileJob("f.pt", "pt", plan_pt(_state()), {})
    seq = writer.write_one_file(store, none, "b", job)
    assert par.format == seq.format == "pt"
    a = torch.load(tmp_path / "a" / "f.pt", weights_only=True)
    b = torch.load(tmp_path / "b" / "f.pt", weights_only=True)
    _assert_same(a, b)


def test_failure_mid_write_removes_the_partial_file(tmp_path, monkeypatch) -> None:
    calls = {"n": 0}
    real = os.pwrite

    def flaky(fd, data, offset):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(28, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(ptlayout.os, "pwrite", flaky)
    path = tmp_path / "x.pt"
    with pytest.raises(OSError, match="No space"):
        ptlayout.write_file(str(path), ziplayout.pt_image(plan_pt(_state())), chunk_bytes=64 << 10)
    assert not path.exists()


def test_manager_round_trip_with_parallel_writer(tmp_path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Linear(300, 7))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    with CheckpointManager(str(tmp_path), {"model": model, "optim": opt}) as mgr:
        mgr.save(1)
        mgr.wait()
        for p in model.parameters():
            p.data.zero_()
        assert mgr.restore_latest() == 1
    assert all(torch.equal(model.state_dict()[k], v) for k, v in ref.items())
    for f in (tmp_path / "step-000000001").iterdir():
        if f.suffix in (".pt", ".mdlus"):
            with zipfile.ZipFile(f) as zf:
                assert zf.testzip() is None


def test_streamed_checksums_equal_zlib_whatever_crc_library_runs() -> None:
    """The checksum of a streamed file (writer) and of a file read back (reader) are zlib's CRC-32 of
    the bytes, computed by the fastest library installed (``crc.crc32``)."""
    from checkpointd.codecs import checksum

    rng = random.Random(5)
    pieces = [os.urandom(rng.choice([0, 1, 31, 4096, 1 << 20])) for _ in range(30)]
    out = io.BytesIO()
    w = checksum.ChecksumWriter(out)
    r = checksum.ChecksumReader()
    for p in pieces:
        w.write(p)
        r.update(memoryview(p))
    data = b"".join(pieces)
    expected = checksum.format_crc(zlib.crc32(data))
    assert out.getvalue() == data and w.nbytes == r.nbytes == len(data)
    assert w.checksum == r.checksum == checksum.checksum_bytes(data) == expected
    assert checksum.crc32 is crc.crc32  # zlib-ng's where installed, not always zlib's
