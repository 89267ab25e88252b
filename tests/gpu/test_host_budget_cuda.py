"""CUDA paths of the host staging budget (``StagingOptions.host_budget_bytes``): a fixed ring of pinned chunks.

Checks pinned memory (the library's own accounting) stays within the budget, no new pinned allocation
after the first save, the checkpoint holds exactly the step's values although the forward pass and the
optimizer step run right after ``maybe_save`` (the hooks wait on the host until the bytes left the
device), bit-exact restore (GradScaler's device scalars and channels_last included), and device
staging combined with the budget.

Skipped where CUDA is unavailable (CI); run on a GPU host with ``python -m pytest tests/gpu -q``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from checkpointd import CheckpointManager, StagingOptions, load
from cuda_models import big_model as _big_model, run_scaled, scaled_cnn, train_step as _train_step

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    n = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return n + sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if torch.is_tensor(v))


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_pinned_within_budget_no_new_allocation_and_exact_values(tmp_path, compression):
    model = _big_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    _train_step(model, opt)
    budget = _state_bytes(model, opt) // 4
    mgr = CheckpointManager(tmp_path, {"model": model, "opt": opt}, compression=compression,
                            staging=StagingOptions(host_budget_bytes=budget), keep_last=None)
    mgr.save(1)
    mgr.wait()
    s1 = mgr.stats()
    assert 0 < s1["pinned_bytes"] <= 1.05 * budget, (s1["pinned_bytes"], budget)
    allocations = s1["staging_allocations"]
    for step in range(2, 5):
        _train_step(model, opt)
        torch.cuda.synchronize()
        expected = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        expected_m = {i: opt.state[p]["exp_avg"].cpu().clone() for i, p in enumerate(model.parameters())}
        assert mgr.maybe_save(step, force=True)
        _train_step(model, opt)  # forward (BatchNorm stats) and optimizer step right away: the hooks hold them
        mgr.wait()
        saved = load(tmp_path, step=step)
        for k, v in expected.items():
            assert torch.equal(saved["model"][k], v), f"step {step}: {k} leaked a later update into the checkpoint"
        for i, m in expected_m.items():
            assert torch.equal(saved["opt"]["state"][i]["exp_avg"], m), f"step {step}: exp_avg {i}"
    s = mgr.stats()
    assert s["staging_allocations"] == allocations, "no new staging allocation after the first save"
    assert s["pinned_bytes"] == s1["pinned_bytes"]
    assert s["staging_hook_wait_secs"] > 0, "the optimizer step must have waited for the stream"
    mgr.close()


def test_bit_exact_resume_with_grad_scaler_and_channels_last(tmp_path):
    def make(seed: int):
        return scaled_cnn(64, 32, seed)

    def run(m, o, sc, steps, gen):
        run_scaled(m, o, sc, steps, gen, 32)

    m1, o1, s1 = make(0)
    gen = torch.Generator(device="cuda").manual_seed(1)
    run(m1, o1, s1, 3, gen)
    state = {"model": m1, "opt": o1, "scaler": s1}
    with CheckpointManager(tmp_path, state, compression="zstd", staging=StagingOptions(host_budget_bytes=8 << 20)) as mgr:
        mgr.save(3)
        expected = {k: v.detach().clone() for k, v in m1.state_dict().items()}
        scale = s1.get_scale()
        run(m1, o1, s1, 2, gen)
    m2, o2, s2 = make(7)
    with CheckpointManager(tmp_path, {"model": m2, "opt": o2, "scaler": s2}, compression="zstd",
                           staging=StagingOptions(host_budget_bytes=8 << 20)) as mgr:
        assert mgr.restore_latest() == 3
    for k, v in m2.state_dict().items():
        assert torch.equal(v, expected[k]) and v.stride() == expected[k].stride(), k
    assert s2.get_scale() == scale


def test_device_staging_with_budget_streams_from_the_gpu_copy(tmp_path):
    model = _big_model(2048, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    _train_step(model, opt)
    nbytes = _state_bytes(model, opt)
    mgr = CheckpointManager(tmp_path, {"model": model, "opt": opt}, compression=None,
                            staging=StagingOptions(device_budget_bytes=2 * nbytes, host_budget_bytes=nbytes // 4))
    mgr.save(1)
    mgr.wait()
    torch.cuda.synchronize()
    expected = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    wait0 = mgr.stats()["staging_hook_wait_secs"]
    mgr.save(2)
    _train_step(model, opt)
    _train_step(model, opt)
    mgr.wait()
    for k, v in expected.items():
        assert torch.equal(load(tmp_path, step=2)["model"][k], v), k
    assert mgr.stats()["staging_hook_wait_secs"] - wait0 < 0.05, "training must not wait on the private copy"
    assert mgr.stats()["pinned_bytes"] <= 1.05 * (nbytes // 4)
    mgr.close()


def test_memory_root_streams_through_the_codec(tmp_path):
    model = _big_model(2048, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _train_step(model, opt)
    torch.cuda.synchronize()
    expected = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    root = f"memory://host-budget-cuda-{id(model)}"
    with CheckpointManager(root, {"model": model, "opt": opt}, compression="zstd",
                           staging=StagingOptions(host_budget_bytes=4 << 20)) as mgr:
        mgr.save(1)
        _train_step(model, opt)
    saved = load(root)
    for k, v in expected.items():
        assert torch.equal(saved["model"][k], v), k
