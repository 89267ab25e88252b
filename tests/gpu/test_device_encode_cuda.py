"""Saves at full speed (preemption saves; here every save, ``writemode.FAST_PERSIST``) with device staging
and ``zstd-planes`` on a local root: the float tensors are encoded on the GPU from the private copy
(``save.device_encode``), and what is committed is exact, also when saves follow each other while
training changes the tensors, when the encoder fails, and without the persist process. Gentle saves
leave the encoding to the host. Skipped where CUDA is unavailable."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from checkpointd import CheckpointManager, StagingOptions, load
from checkpointd.codecs import encode_device
from checkpointd.storage import persist_process, writemode

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


class _Mixed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(1024, 1024).cuda()
        self.b = torch.nn.Linear(1024, 1024).cuda().to(torch.bfloat16)
        self.c = torch.nn.Linear(1024, 512).cuda().double()
        self.register_buffer("steps", torch.zeros(300_000, dtype=torch.int64, device="cuda"))

    def forward(self, x):
        y = self.a(x)
        y = self.b(y.to(torch.bfloat16)).float()
        return self.c(y.double()).float()


def _step(model, opt):
    x = torch.randn(16, 1024, device="cuda")
    loss = model(x).square().mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    model.steps += 1


def _values(model, opt):
    return copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()["state"]})


def _assert_equal(saved, expected):
    for k, v in expected["model"].items():
        assert torch.equal(saved["model"][k].cpu(), v.cpu()), k
    for i, st in expected["opt"].items():
        for k, v in st.items():
            assert torch.equal(saved["optimizer"]["state"][i][k].cpu(), v.cpu()), (i, k)


@pytest.fixture(autouse=True)
def fast(monkeypatch):
    monkeypatch.setattr(writemode, "FAST_PERSIST", True)


@pytest.fixture
def spy(monkeypatch):
    calls = []
    real = encode_device.encode_records

    def counting(records, *args, **kwargs):
        real(records, *args, **kwargs)
        calls.append(sum(r.frames is not None for r in records))  # (not reached when the encoder fails)

    monkeypatch.setattr(encode_device, "encode_records", counting)
    return calls


def _manager(root, model, opt):
    return CheckpointManager(root, {"model": model, "optimizer": opt}, compression="zstd-planes",
                             staging=StagingOptions(device_budget_bytes=4 << 30))


def test_saves_encoded_on_the_device_are_exact_while_training_goes_on(tmp_path, spy, caplog) -> None:
    model = _Mixed()
    opt = torch.optim.AdamW(model.parameters())
    _step(model, opt)
    expected = {}
    with caplog.at_level(logging.WARNING, logger="checkpointd"), _manager(tmp_path, model, opt) as mgr:
        for step in (1, 2, 3):
            assert mgr.maybe_save(step, force=True)
            expected[step] = _values(model, opt)
            _step(model, opt)  # overwrites the live tensors at once: the clone must hold the save's values
            _step(model, opt)
        mgr.wait()
        stats = mgr.stats()["last_save"]
    assert len(spy) == 3 and all(n >= 6 for n in spy)  # weights, and two AdamW moments each, all encoded there
    assert "planes encoder failed" not in caplog.text
    assert stats["bytes_written"] < 0.9 * stats["raw_bytes"]
    for step, values in expected.items():
        _assert_equal(load(tmp_path, step=step), values)
    fresh = _Mixed()
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    _step(fresh, fresh_opt)
    with _manager(tmp_path, fresh, fresh_opt) as mgr:
        assert mgr.restore_latest() == 3
    _assert_equal({"model": fresh.state_dict(), "optimizer": fresh_opt.state_dict()}, expected[3])


def test_an_encoder_failure_saves_the_tensors_encoded_on_the_host(tmp_path, monkeypatch, caplog) -> None:
    def refuse(*args, **kwargs):
        raise encode_device.DeviceEncodeError("refused")

    monkeypatch.setattr(encode_device, "encode_records", refuse)
    expected, _ = _save_once(tmp_path)
    _assert_equal(load(tmp_path, step=1), expected)


def _save_once(tmp_path, budget: int | None = None):
    """One save of a trained ``_Mixed`` while training goes on; the values saved and the save's stats."""
    model = _Mixed()
    opt = torch.optim.AdamW(model.parameters())
    _step(model, opt)
    if budget is None:
        mgr = _manager(tmp_path, model, opt)
    else:
        mgr = CheckpointManager(tmp_path, {"model": model, "optimizer": opt}, compression="zstd-planes",
                                staging=StagingOptions(device_budget_bytes=budget))
    with mgr:
        mgr.save(1)
        expected = _values(model, opt)
        _step(model, opt)
        mgr.wait()
        return expected, mgr.stats()["last_save"]


def test_without_the_persist_process_the_native_bytes_come_back_first(tmp_path, monkeypatch, spy) -> None:
    monkeypatch.setattr(persist_process, "client", lambda: None)
    expected, _ = _save_once(tmp_path)
    assert spy and spy[0] >= 6
    _assert_equal(load(tmp_path, step=1), expected)


def test_a_budget_without_room_for_the_encoder_copies_the_tensors(tmp_path, spy) -> None:
    model = _Mixed()
    state = 3 * sum(p.untyped_storage().nbytes() for p in model.parameters()) + model.steps.nbytes  # + AdamW moments
    expected, _ = _save_once(tmp_path, budget=state + (1 << 20))
    assert not spy  # the clone fits, the encoder's batches would not: encoded on the host
    _assert_equal(load(tmp_path, step=1), expected)


def test_gentle_saves_are_encoded_on_the_host(tmp_path, monkeypatch, spy) -> None:
    monkeypatch.setattr(writemode, "FAST_PERSIST", False)
    expected, stats = _save_once(tmp_path)
    assert not spy
    assert stats["bytes_written"] < 0.9 * stats["raw_bytes"]
    _assert_equal(load(tmp_path, step=1), expected)
