"""Fast restore of local files (``fastload``): verified parallel reads, tensors built in place."""

from __future__ import annotations

import functools
import io
import os
import pickle
import zipfile
import zlib

import pytest
import torch

from checkpointd.restore import verify
from checkpointd.storage import iopool
from checkpointd import CheckpointManager
from checkpointd.restore import fastload
from checkpointd.restore import step as restore
from checkpointd.restore import step as restore_mod
from checkpointd.errors import CorruptCheckpointError, UnsafeCheckpointError



def _map_files(monkeypatch, mapped: bool) -> None:
    """Map every non-empty local file (as on tmpfs in a CUDA process), or read every one."""
    monkeypatch.setattr(fastload, "use_mmap", lambda path, size: mapped and size > 0)

def _train_state():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 500), torch.nn.ReLU(), torch.nn.Linear(500, 9))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    return model, opt


def _snapshot(model, opt):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            {i: {k: v.clone() for k, v in s.items()} for i, s in enumerate(opt.state.values())})


def _same(model, opt, ref) -> bool:
    ms, os_ = _snapshot(model, opt)
    return all(torch.equal(ms[k], v) for k, v in ref[0].items()) and all(
        torch.equal(os_[i][k], v) for i, s in ref[1].items() for k, v in s.items())


def _scramble(model, opt) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(3.0)
        for s in opt.state.values():
            for v in s.values():
                if isinstance(v, torch.Tensor) and v.dim():
                    v.fill_(7.0)


@pytest.mark.parametrize("compression", [None, "zstd", "zstd-planes"])
def test_restore_is_bit_exact_and_uses_the_fast_path(tmp_path, monkeypatch, compression) -> None:
    model, opt = _train_state()
    ref = _snapshot(model, opt)
    calls = []
    real = fastload.load_native_in_place
    monkeypatch.setattr(fastload, "load_native_in_place", lambda buf, fmt: calls.append(fmt) or real(buf, fmt))
    with CheckpointManager(str(tmp_path), {"model": model, "optim": opt}, compression=compression) as mgr:
        mgr.save(1)
        mgr.wait()
        _scramble(model, opt)
        assert mgr.restore_latest() == 1
    assert _same(model, opt, ref)
    assert calls, "the in-place loader ran"


def test_plain_and_fast_paths_agree(tmp_path, monkeypatch) -> None:
    model, opt = _train_state()
    ref = _snapshot(model, opt)
    with CheckpointManager(str(tmp_path), {"model": model, "optim": opt}) as mgr:
        mgr.save(1)
        mgr.wait()
        with monkeypatch.context() as m:  # the plain path, as for files that are not local
            m.setattr(restore, "fast_read_applies", lambda store, entry: False)
            _scramble(model, opt)
            mgr.restore(1)
            assert _same(model, opt, ref)
        _scramble(model, opt)
        mgr.restore(1)
        assert _same(model, opt, ref)


@pytest.mark.parametrize("mapped", ["0", "1"])
@pytest.mark.parametrize("compression", [None, "zstd"])
def test_corrupted_byte_is_refused_before_anything_is_applied(tmp_path, monkeypatch, compression, mapped) -> None:
    """Mapped uncompressed files are parsed while checksummed: a bad checksum still refuses the parse."""
    _map_files(monkeypatch, mapped == "1")
    model, opt = _train_state()
    with CheckpointManager(str(tmp_path), {"model": model, "optim": opt}, compression=compression) as mgr:
        mgr.save(1)
        mgr.wait()
    step_dir = tmp_path / "step-000000001"
    files = sorted(f for f in step_dir.iterdir() if f.name not in ("manifest.json", "COMMITTED"))
    victim = max(files, key=lambda f: f.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x40
    victim.write_bytes(bytes(data))
    _scramble(model, opt)
    scrambled = _snapshot(model, opt)
    with CheckpointManager(str(tmp_path), {"model": model, "optim": opt}, compression=compression) as mgr:
        with pytest.raises(CorruptCheckpointError):
            mgr.restore(1)
    assert _same(model, opt, scrambled), "nothing was applied"


def test_truncated_file_is_refused(tmp_path) -> None:
    model, opt = _train_state()
    with CheckpointManager(str(tmp_path), {"model": model, "optim": opt}) as mgr:
        mgr.save(1)
        mgr.wait()
        victim = max((f for f in (tmp_path / "step-000000001").iterdir()), key=lambda f: f.stat().st_size)
        victim.write_bytes(victim.read_bytes()[:-10])
        with pytest.raises(CorruptCheckpointError, match="bytes"):
            mgr.restore(1)


@pytest.mark.parametrize("mapped", ["0", "1"])
def test_read_file_verified_crc_matches_zlib(tmp_path, monkeypatch, mapped) -> None:
    _map_files(monkeypatch, mapped == "1")
    monkeypatch.setattr(fastload, "READ_CHUNK_BYTES", 100_000)
    monkeypatch.setattr(fastload, "MAP_CRC_BYTES", 300_000)
    data = os.urandom(1_234_567)
    p = tmp_path / "blob"
    p.write_bytes(data)
    buf, size, checksum = fastload.read_file_verified(str(p), len(data), "blob")
    assert size == len(data) and bytes(buf.numpy()) == data
    assert checksum == f"crc32:{zlib.crc32(data):08x}"


def test_device_verify_replaces_the_host_checksum(tmp_path, monkeypatch) -> None:
    _map_files(monkeypatch, True)
    data = os.urandom(100_000)
    p = tmp_path / "blob"
    p.write_bytes(data)
    seen: list[bytes] = []
    _, _, checksum = fastload.read_file_verified(str(p), len(data), "blob",
                                                 device_verify=lambda b: seen.append(bytes(b.numpy())) or 0x1234)
    assert seen == [data] and checksum == "crc32:00001234"


@pytest.mark.parametrize("mapped", ["0", "1"])
def test_files_are_parsed_once_and_only_after_they_verify(tmp_path, monkeypatch, mapped) -> None:
    """Each file is parsed once, after its checksum matched the manifest, mapped or read."""
    _map_files(monkeypatch, mapped == "1")
    model, opt = _train_state()
    ref = _snapshot(model, opt)
    with CheckpointManager(str(tmp_path), {"model": model, "optim": opt}, compression=None) as mgr:
        mgr.save(1)
        mgr.wait()
        calls = []
        checked: list[str] = []
        real = fastload.load_native_in_place
        real_check = verify.check_file

        def parse(buf, fmt):
            assert len(checked) == len(calls) + 1, "a file was parsed before its checksum was compared"
            calls.append(fmt)
            return real(buf, fmt)

        monkeypatch.setattr(fastload, "load_native_in_place", parse)
        monkeypatch.setattr(restore_mod, "check_file", lambda *a: checked.append(a[0]) or real_check(*a))
        monkeypatch.setattr(restore_mod, "read_step", functools.partial(restore_mod.read_step, threads=1))
        _scramble(model, opt)
        assert mgr.restore_latest() == 1
    assert _same(model, opt, ref)
    files = [f for f in (tmp_path / "step-000000001").iterdir() if f.suffix in (".pt", ".mdlus")]
    assert len(calls) == len(files) == 2


def test_run_tasks_runs_meanwhile_once_on_every_path() -> None:

    for n, lanes in ((0, None), (1, None), (5, None), (5, 2)):
        log: list[str] = []
        out = iopool.run_tasks([lambda i=i: i * i for i in range(n)], lanes=lanes, meanwhile=lambda: log.append("m"))
        assert out == [i * i for i in range(n)] and log == ["m"], (n, lanes)


def test_in_place_tensors_view_the_buffer_and_mdlus_member() -> None:
    obj = {"a": torch.randn(1000), "b": torch.arange(5)}
    raw = io.BytesIO()
    torch.save(obj, raw)  # a torch-written file loads in place too
    buf = torch.frombuffer(bytearray(raw.getvalue()), dtype=torch.uint8)
    back = fastload.load_native_in_place(buf, "pt")
    assert torch.equal(back["a"], obj["a"]) and torch.equal(back["b"], obj["b"])
    lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel()
    assert lo <= back["a"].data_ptr() < hi, "no copy of the record"
    outer = io.BytesIO()
    with zipfile.ZipFile(outer, "w") as zf:
        zf.writestr("args.json", "{}")
        zf.writestr("metadata.json", "{}")
        zf.writestr("model.pt", raw.getvalue())
    mbuf = torch.frombuffer(bytearray(outer.getvalue()), dtype=torch.uint8)
    back = fastload.load_native_in_place(mbuf, "mdlus")
    assert torch.equal(back["a"], obj["a"])


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_unsafe_pickle_is_refused_through_the_fast_path(tmp_path) -> None:
    """A crafted data.pkl in a locally stored file never runs, and the error says unsafe."""
    raw = io.BytesIO()
    torch.save({"x": torch.ones(2)}, raw)
    src = zipfile.ZipFile(io.BytesIO(raw.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as zf:
        for info in src.infolist():
            payload = src.read(info.filename)
            if info.filename.endswith("data.pkl"):
                payload = pickle.dumps({"x": _Evil()}, protocol=2)
            zf.writestr(info.filename, payload)
    data = out.getvalue()
    p = tmp_path / "evil.pt"
    p.write_bytes(data)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    with pytest.raises(Exception):
        fastload.load_native_in_place(buf, "pt")
    with pytest.raises(UnsafeCheckpointError):
        restore.load_native(fastload.BufferReader(memoryview(buf.numpy())), "pt", "evil.pt")


# -- the in-place loader's C unpickler for core globals ---------------------------------------------


def _pt_bytes(obj) -> torch.Tensor:
    bio = io.BytesIO()
    torch.save(obj, bio)
    return torch.frombuffer(bytearray(bio.getvalue()), dtype=torch.uint8)


def test_state_dicts_load_in_place_like_torch_load(monkeypatch):
    model, opt = _train_state()
    sd = {"model": model.state_dict(), "optimizer_state_dict": opt.state_dict(), "epoch": 4,
          "extra": {"dtype_free": [1, 2.5, "x", None, True], "bf16": torch.ones(3, dtype=torch.bfloat16),
                    "param": torch.nn.Parameter(torch.ones(2)), "size": torch.Size([2, 3]),
                    "s": {1, 2, 3}, "c": complex(1, 2)}}
    got = fastload.load_pt_in_place(_pt_bytes(sd))
    want = torch.load(io.BytesIO(_pt_bytes(sd).numpy().tobytes()), weights_only=True)
    from tree_compare import assert_tree_equal

    assert_tree_equal(got, want)


def _build_attack_pickle() -> bytes:
    """A .pt whose pickle uses only allowed globals, then BUILD to overwrite the defaults of one of them."""
    import zipfile

    bio = io.BytesIO()
    torch.save({"x": torch.ones(2)}, bio)
    src = zipfile.ZipFile(io.BytesIO(bio.getvalue()))
    pkl_name = next(n for n in src.namelist() if n.endswith("data.pkl"))
    payload = (b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n"  # PROTO 2, GLOBAL (allowed)
               b"N}X\x0b\x00\x00\x00__defaults__(K\x00tsb"   # BUILD with (None, {"__defaults__": (0,)})
               b"0}X\x01\x00\x00\x00xK\x01s.")               # POP, {"x": 1}, STOP
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            dst.writestr(info, payload if info.filename == pkl_name else src.read(info))
    return out.getvalue()


def test_a_pickle_that_torch_refuses_is_refused_and_changes_nothing():
    """torch.load(weights_only=True) refuses a BUILD on a function; so does the in-place loader, and the
    function keeps its defaults."""
    import torch._utils as tu

    data = _build_attack_pickle()
    before = (tu._rebuild_tensor_v2.__defaults__, tu._rebuild_tensor_v2.__kwdefaults__)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(io.BytesIO(data), weights_only=True)
    with pytest.raises(pickle.UnpicklingError):
        fastload.load_pt_in_place(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    assert (tu._rebuild_tensor_v2.__defaults__, tu._rebuild_tensor_v2.__kwdefaults__) == before


def test_code_in_a_pickle_never_runs_through_either_unpickler(tmp_path, monkeypatch):
    ran = []

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    bio = io.BytesIO()
    torch.save({"x": torch.ones(2), "evil": Evil()}, bio)
    monkeypatch.setattr(os, "system", lambda *a: ran.append(a))  # would record a call, if one were made
    with pytest.raises(pickle.UnpicklingError):
        fastload.load_pt_in_place(torch.frombuffer(bytearray(bio.getvalue()), dtype=torch.uint8))
    assert ran == []


def test_memory_files_are_mapped_only_in_a_process_that_uses_cuda(monkeypatch) -> None:
    """A CUDA host training on its CPU reads (restored state views the buffer); a GPU-training process maps."""
    monkeypatch.setattr(fastload, "_fs_type", lambda path: "tmpfs")
    big = fastload.MMAP_MIN_BYTES
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert not fastload.use_mmap("/x", big)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert fastload.use_mmap("/x", big)
    assert not fastload.use_mmap("/x", big - 1)
    monkeypatch.setattr(fastload, "_fs_type", lambda path: "ext4")
    assert not fastload.use_mmap("/x", big)


@pytest.mark.parametrize("cuda_in_use", [False, True])
def test_cpu_state_on_a_cuda_host_restores_through_a_read(tmp_path, monkeypatch, cuda_in_use) -> None:
    """The whole restore on a (simulated) CUDA host: mapped only once the process has brought up CUDA."""
    model, opt = _train_state()
    ref = _snapshot(model, opt)
    with CheckpointManager(tmp_path, {"model": model, "optim": opt}) as mgr:
        mgr.save(1)
        mgr.wait()
        _scramble(model, opt)
        monkeypatch.setattr(fastload, "MMAP_MIN_BYTES", 1)
        monkeypatch.setattr(fastload, "_fs_type", lambda path: "tmpfs")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: cuda_in_use)
        maps: list[int] = []
        real_map = fastload._map_file
        monkeypatch.setattr(fastload, "_map_file", lambda fd, size: maps.append(size) or real_map(fd, size))
        mgr.restore(1)
    assert _same(model, opt, ref)
    assert bool(maps) == cuda_in_use
