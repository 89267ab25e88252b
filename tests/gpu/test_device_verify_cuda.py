"""Restore verified on the GPU (``device_image`` + ``device_crc``): bit-exact, corruption caught, fallbacks.

The saved checkpoint is mapped (``fastload.use_mmap`` as on tmpfs) and every file is verified on the device
(``MIN_BYTES`` lowered): uploaded through the pinned bounce chunks, checksummed by the NVRTC-built kernels,
applied device to device. Skipped where CUDA is unavailable.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from checkpointd import CheckpointManager
from checkpointd.errors import CorruptCheckpointError
from checkpointd.native import cuda_rtc
from checkpointd.native import upload as upload_native
from checkpointd.codecs import device_crc
from checkpointd.restore import bounce, device_image, fastload

from test_restore_cuda import _assert_same, _model, _scramble, _trained, _use

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture
def on_device(monkeypatch):
    monkeypatch.setattr(fastload, "use_mmap", lambda path, size: size > 0)
    monkeypatch.setenv("CHECKPOINTD_RESTORE_VERIFY", "device")  # (the default; read by options.restore_verify_on)
    monkeypatch.setattr(device_image, "MIN_BYTES", 1)


@pytest.fixture
def saved(tmp_path):
    import copy

    model, opt = _trained()
    with CheckpointManager(str(tmp_path), {"model": model, "optim": opt}, compression=None) as mgr:
        mgr.save(1)
        mgr.wait()
    ref_model, ref_opt = copy.deepcopy((model, opt))
    return tmp_path, ref_model, ref_opt


@pytest.mark.parametrize("use_kernel", [True, False])
def test_device_crc_equals_zlib(use_kernel) -> None:
    rng = np.random.default_rng(0)
    for n in (0, 7, 4096, 4096 * 5 + 3, 1 << 20, (37 << 20) + 4093):
        if not use_kernel and n > (1 << 20):
            continue  # the torch-ops lanes launch ~10 kernels per word column
        host = rng.integers(0, 256, n, dtype=np.uint8)
        buf = torch.from_numpy(host).cuda()
        assert device_crc.crc32_of(buf, use_kernel=use_kernel) == zlib.crc32(host.tobytes()), n


def test_many_device_crcs_at_once_equal_zlib() -> None:
    rng = np.random.default_rng(1)
    sizes = [0, 7, 4096, 4096 * 5 + 3, 1 << 20, (1 << 20) + 4096, (37 << 20) + 4093, 3 * 4096, 4096 * 5 + 11]
    hosts = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    bufs = [torch.from_numpy(h).cuda() for h in hosts]
    assert device_crc.crc32_many(bufs) == [zlib.crc32(h.tobytes()) for h in hosts]
    assert device_crc.crc32_many(bufs[2:3] + [bufs[4][4:]]) == [zlib.crc32(hosts[2].tobytes()),
                                                             zlib.crc32(hosts[4][4:].tobytes())]


def test_crc_of_a_buffer_not_16_byte_aligned_takes_torch_ops() -> None:
    host = np.random.default_rng(5).integers(0, 256, 3 * 4096 + 4 + 9, dtype=np.uint8)
    buf = torch.from_numpy(host).cuda()[4:]  # 4-byte aligned only: the kernel's 16-byte loads do not apply
    assert device_crc.crc32_of(buf) == zlib.crc32(host[4:].tobytes())


def test_nvrtc_builds_the_kernels_and_reports_compile_errors() -> None:
    major, minor = torch.cuda.get_device_capability()
    cubin = cuda_rtc.compile_cubin(device_crc.KERNEL_SOURCE, f"{major}{minor}")
    assert cubin[:4] == b"\x7fELF"  # machine code for this GPU, not PTX
    with pytest.raises(cuda_rtc.KernelUnavailable, match="undefined"):
        cuda_rtc.compile_cubin('extern "C" __global__ void broken() { not_declared = 1; }', f"{major}{minor}")


_FRESH = """
import json, zlib, torch
from checkpointd.native import cuda_rtc
from checkpointd.codecs import device_crc
buf = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, device="cuda")
ok = device_crc.kernel_available(buf.device) and device_crc.crc32_of(buf) == zlib.crc32(buf.cpu().numpy().tobytes())
print(json.dumps({"ok": ok, "origin": list(cuda_rtc.load_origin.values())}))
"""


def test_a_fresh_process_loads_the_stored_kernel_and_rebuilds_a_corrupt_one(tmp_path) -> None:
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, CHECKPOINTD_CACHE_DIR=str(tmp_path / "kernels"))  # options.cache_dir()

    def fresh() -> dict:
        proc = subprocess.run([sys.executable, "-c", _FRESH], env=env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])
    assert fresh() == {"ok": True, "origin": ["compiled"]}
    (stored,) = (tmp_path / "kernels").iterdir()
    good = stored.read_bytes()
    assert fresh() == {"ok": True, "origin": ["cache"]}
    stored.write_bytes(good[:200])  # a truncated cubin (a disk filled up, say): never handed to the driver
    assert fresh() == {"ok": True, "origin": ["compiled"]}
    assert len(stored.read_bytes()) == len(good)  # stored again, whole
    assert fresh() == {"ok": True, "origin": ["cache"]}


@pytest.mark.parametrize("n", [1, 4093, (2 << 20) + 1, (67 << 20) + 4093])
def test_native_upload_equals_the_source(tmp_path, n) -> None:
    """A mapped file (private mapping, pages faulted in by the upload's threads) into device memory that the
    current stream was still writing (the copies must wait for it), with fewer slots than pieces."""
    import mmap

    assert upload_native.library() is not None, f"the GPU host builds the native upload: {upload_native.why_not}"
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    path = tmp_path / "blob"
    path.write_bytes(data.tobytes())
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), n, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    src = torch.frombuffer(m, dtype=torch.uint8)
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    torch.cuda._sleep(20_000_000)  # the current stream stays busy, then fills dst: the upload must come after
    dst.fill_(7)
    pinned = [torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True) for _ in range(4)]
    upload_native.upload_pairs([(dst, src)], pinned, workers=4)  # 8 slots of 512 KiB
    assert torch.equal(dst.cpu(), torch.from_numpy(data))
    del src
    m.close()


def test_a_native_upload_failure_falls_back_to_the_python_bounce(monkeypatch) -> None:
    def broken(*a, **k):
        raise upload_native.UploadError("native upload failed in cuMemcpyHtoDAsync (test)")

    monkeypatch.setattr(upload_native, "upload_pairs", broken)
    src = torch.randint(0, 256, ((5 << 20) + 3,), dtype=torch.uint8)
    dst = torch.empty_like(src, device="cuda")
    bounce.upload_bytes(dst, src)
    assert torch.equal(dst.cpu(), src)


@pytest.mark.parametrize("upload", ["native", "python"])
def test_restore_verified_on_device_is_exact_and_in_place(saved, on_device, monkeypatch, upload) -> None:
    _use(monkeypatch, upload)
    assert device_crc.kernel_available(torch.device("cuda")), "the GPU host builds the CRC kernels with NVRTC"
    root, ref_model, ref_opt = saved
    model, opt = _trained()
    _scramble(model, opt)
    held = {id(p): dict(opt.state[p]) for p in model.parameters()}
    before = dict(device_image.stats)
    with CheckpointManager(str(root), {"model": model, "optim": opt}, compression=None) as mgr:
        assert mgr.restore_latest() == 1
    torch.cuda.synchronize()
    assert device_image.stats["verified"] - before["verified"] >= 1
    assert device_image.stats["copies"] - before["copies"] > 10  # the tensors came from the images
    assert device_image.stats["failed"] == before["failed"] and device_image.stats["no_room"] == before["no_room"]
    _assert_same(ref_model, ref_opt, model, opt)
    for p in model.parameters():
        for key, t in held[id(p)].items():
            assert opt.state[p][key] is t, f"{key} was replaced, not written in place"
    assert not any(r.images for r in device_image._active), "images outlived the restore"


def test_restore_into_fresh_optimizer_verified_on_device(saved, on_device) -> None:
    root, ref_model, ref_opt = saved
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    before = device_image.stats["verified"]
    with CheckpointManager(str(root), {"model": model, "optim": opt}, compression=None) as mgr:
        assert mgr.restore_latest() == 1
    torch.cuda.synchronize()
    assert device_image.stats["verified"] > before
    _assert_same(ref_model, ref_opt, model, opt)


def test_a_corrupt_file_fails_on_device_and_leaves_the_live_state(saved, on_device) -> None:
    root, _, _ = saved
    step = next(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step"))
    victim = max((f for f in step.iterdir() if f.is_file()), key=lambda f: f.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01  # same size: only the checksum can tell
    victim.write_bytes(bytes(data))
    model, opt = _trained()
    _scramble(model, opt)
    live = [t.clone() for t in model.state_dict().values()]
    before = device_image.stats["verified"]
    with CheckpointManager(str(root), {"model": model, "optim": opt}, compression=None) as mgr:
        with pytest.raises(CorruptCheckpointError):
            mgr.restore(1)
    assert device_image.stats["verified"] > before  # it was checked on the device
    for a, b in zip(live, model.state_dict().values()):
        assert torch.equal(a, b)


def test_no_room_on_the_device_falls_back_to_the_host_checksum(saved, on_device, monkeypatch) -> None:
    root, ref_model, ref_opt = saved
    monkeypatch.setattr(device_image, "HEADROOM_BYTES", 1 << 50)
    model, opt = _trained()
    _scramble(model, opt)
    before = dict(device_image.stats)
    with CheckpointManager(str(root), {"model": model, "optim": opt}, compression=None) as mgr:
        assert mgr.restore_latest() == 1
    assert device_image.stats["no_room"] > before["no_room"]
    assert device_image.stats["verified"] == before["verified"]
    _assert_same(ref_model, ref_opt, model, opt)


def test_a_failing_device_checksum_falls_back_to_the_host(saved, on_device, monkeypatch) -> None:
    root, ref_model, ref_opt = saved

    def broken(*a, **k):
        raise RuntimeError("kernel failed (test)")

    monkeypatch.setattr(device_crc, "crc32_start", broken)
    model, opt = _trained()
    _scramble(model, opt)
    before = dict(device_image.stats)
    with CheckpointManager(str(root), {"model": model, "optim": opt}, compression=None) as mgr:
        assert mgr.restore_latest() == 1
    assert device_image.stats["failed"] > before["failed"]
    _assert_same(ref_model, ref_opt, model, opt)
