"""``zstd-planes`` restores decoded on the GPU (``codecs.planes_device``): bit-exact, in place, and damage caught.

The checkpoint is mapped (``fastload.use_mmap`` as on tmpfs); its files are uploaded, checksummed and
decoded on the device, and the live CUDA tensors are filled from there. Skipped where CUDA is unavailable.
"""

from __future__ import annotations

import copy
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from checkpointd import CheckpointManager
from checkpointd.codecs.compress import decode_bytes
from checkpointd.codecs.planes_device import decode_on_device
from checkpointd.errors import CorruptCheckpointError
from checkpointd.restore import device_image, fastload

from planes_files import planes_file
from test_restore_cuda import _assert_same, _model, _scramble

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture
def on_device(monkeypatch):
    monkeypatch.setattr(fastload, "use_mmap", lambda path, size: size > 0)
    monkeypatch.setenv("CHECKPOINTD_RESTORE_VERIFY", "device")
    monkeypatch.setattr(device_image, "MIN_BYTES", 1)


def _trained_mixed(seed: int = 0):
    """``_trained``'s model with a bf16 weight and an fp64 bias (2- and 8-byte planes), and their AdamW state."""
    torch.manual_seed(seed)
    model = _model()
    with torch.no_grad():
        model[4].weight.data = model[4].weight.data.to(torch.bfloat16)
        model[3].bias.data = model[3].bias.data.double()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):  # (no forward: the layers' dtypes differ)
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
        opt.zero_grad()
    return model, opt


@pytest.fixture
def saved(tmp_path):
    model, opt = _trained_mixed()
    with CheckpointManager(str(tmp_path), {"model": model, "optim": opt}, compression="zstd-planes") as mgr:
        mgr.save(1)
        mgr.wait()
    return tmp_path, copy.deepcopy((model, opt))


def _fresh_like(ref_model):
    model, opt = _trained_mixed(1)
    _scramble(model, opt)
    return model, opt


def test_a_planes_restore_is_decoded_on_the_device_exactly_and_in_place(saved, on_device) -> None:
    root, (ref_model, ref_opt) = saved
    model, opt = _fresh_like(ref_model)
    held = {id(p): dict(opt.state[p]) for p in model.parameters()}
    before = dict(device_image.stats)
    with CheckpointManager(str(root), {"model": model, "optim": opt}, compression="zstd-planes") as mgr:
        assert mgr.restore_latest() == 1
    torch.cuda.synchronize()
    got = {k: device_image.stats[k] - before[k] for k in before}
    assert got["decoded"] >= 1 and got["failed"] == 0 and got["copies"] > 10
    assert got["host_filled_bytes"] == 0, "the host read bytes that only the device had decoded"
    _assert_same(ref_model, ref_opt, model, opt)
    for p in model.parameters():
        for key, t in held[id(p)].items():  # (torch keeps a CPU step as stored: only the moments are in place)
            assert key == "step" or opt.state[p][key] is t, f"{key} was replaced, not written in place"


def test_a_fresh_optimizer_restores_from_a_device_decoded_file(saved, on_device) -> None:
    root, (ref_model, ref_opt) = saved
    model, _ = _fresh_like(ref_model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = device_image.stats["decoded"]
    with CheckpointManager(str(root), {"model": model, "optim": opt}, compression="zstd-planes") as mgr:
        assert mgr.restore_latest() == 1
    assert device_image.stats["decoded"] > before
    _assert_same(ref_model, ref_opt, model, opt)


def test_a_damaged_planes_file_is_refused_on_the_device_path_and_nothing_changes(saved, on_device) -> None:
    root, (ref_model, _) = saved
    step = next(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step"))
    victim = max((f for f in step.iterdir() if f.is_file()), key=lambda f: f.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 3] ^= 0x04
    victim.write_bytes(bytes(data))
    model, opt = _fresh_like(ref_model)
    live = [t.clone() for t in model.state_dict().values()]
    with CheckpointManager(str(root), {"model": model, "optim": opt}, compression="zstd-planes") as mgr:
        with pytest.raises(CorruptCheckpointError):
            mgr.restore(1)
    for a, b in zip(live, model.state_dict().values()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_the_cuda_decoder_equals_the_host_decoder(dtype) -> None:
    native, stored = planes_file(dtype, 3_000_001)
    on_gpu = torch.frombuffer(bytearray(stored), dtype=torch.uint8).cuda()
    with ThreadPoolExecutor(4) as pool:
        out = decode_on_device(memoryview(stored), on_gpu, pool)
    assert out.data.device.type == "cuda"
    assert bytes(decode_bytes("zstd-planes", stored)) == native
    assert torch.equal(out.data.cpu(), torch.frombuffer(bytearray(native), dtype=torch.uint8))
