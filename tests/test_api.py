"""The public API of SPEC §1 and the file layout of SPEC §3, through ``CheckpointManager`` only."""

from __future__ import annotations

import json
import time

import pytest
import torch

import checkpointd
from checkpointd import (
    CheckpointError,
    CheckpointManager,
    CheckpointNotFoundError,
    CheckpointWriteError,
    IOOptions,
    StepAlreadyExistsError,
    load,
)
from checkpointd.testing.faults import Fault, FaultPlan


def test_public_names_are_pinned():
    assert sorted(checkpointd.__all__) == sorted([
        "CheckpointManager",
        "load",
        "allow_tensor_subclasses",
        "register_dequantizer",
        "register_inner_sharding",
        "DistributedOptions",
        "IOOptions",
        "StagingOptions",
        "CheckpointError",
        "CheckpointWriteError",
        "CheckpointNotFoundError",
        "CheckpointTimeoutError",
        "ConfigError",
        "LinkedPathError",
        "RootInUseError",
        "CorruptCheckpointError",
        "IncompleteCheckpointError",
        "ManifestError",
        "StateError",
        "StateMismatchError",
        "StepAlreadyExistsError",
        "UnacceptedSubclassError",
        "UnsafeCheckpointError",
        "__version__",
    ])
    for name in checkpointd.__all__:
        assert hasattr(checkpointd, name), name


def test_every_error_derives_from_checkpoint_error():
    errors = [getattr(checkpointd, n) for n in checkpointd.__all__ if n.endswith("Error")]
    for cls in errors:
        assert issubclass(cls, CheckpointError), cls
    assert issubclass(checkpointd.CheckpointTimeoutError, TimeoutError)
    assert issubclass(checkpointd.CheckpointNotFoundError, FileNotFoundError)
    assert issubclass(checkpointd.ConfigError, ValueError)
    assert issubclass(StepAlreadyExistsError, FileExistsError)


def test_context_manager_waits_and_closes(tmp_path):
    with CheckpointManager(tmp_path, {"t": torch.ones(1)}) as mgr:
        assert mgr.maybe_save(0, force=True) is True
        assert mgr.save(1) is None
        assert mgr.wait_for_snapshot() is None  # CPU: the copies are already done
    assert (tmp_path / "step-000000001" / "COMMITTED").exists()
    with pytest.raises(CheckpointError, match="closed"):
        mgr.maybe_save(2, force=True)
    mgr.close()  # idempotent


def test_context_manager_does_not_mask_the_users_exception(tmp_path):
    plan = FaultPlan(Fault(op="open", path="*step-*"))
    with pytest.raises(KeyError):
        with CheckpointManager(f"faulty://{tmp_path}", {"t": torch.ones(1)}, io=IOOptions(retry_timeout_secs=0),
                               storage_options={"target_protocol": "file", "faults": plan}) as mgr:
            mgr.save(1)
            raise KeyError("user error")


def test_wait_timeout_zero_with_a_slow_save(tmp_path):
    plan = FaultPlan(Fault(op="open", error=None, delay_secs=0.5, path="*step-*"))
    with CheckpointManager(f"faulty://{tmp_path}", {"t": torch.ones(1)},
                           storage_options={"target_protocol": "file", "faults": plan}) as mgr:
        mgr.save(1)
        with pytest.raises(CheckpointError) as info:
            mgr.wait(timeout=0)
        assert isinstance(info.value, TimeoutError)
        assert "step 1" in str(info.value)
        mgr.wait()
        assert mgr.steps() == [1]


def test_wait_timeout_is_not_a_write_error_and_save_goes_on(tmp_path):
    plan = FaultPlan(Fault(op="open", error=None, delay_secs=0.3, path="*step-*"))
    with CheckpointManager(f"faulty://{tmp_path}", {"t": torch.ones(1)},
                           storage_options={"target_protocol": "file", "faults": plan}) as mgr:
        mgr.save(1)
        with pytest.raises(TimeoutError) as info:
            mgr.wait(timeout=0.01)
        assert not isinstance(info.value, CheckpointWriteError)
    assert load(tmp_path)["t"].item() == 1


def test_saving_a_committed_step_raises_unless_overwrite(tmp_path):
    t = torch.ones(2)
    with CheckpointManager(tmp_path, {"t": t}) as mgr:
        mgr.save(3)
        mgr.wait()
        t.fill_(5)
        with pytest.raises(StepAlreadyExistsError, match="overwrite=True"):
            mgr.save(3)
        with pytest.raises(StepAlreadyExistsError):
            mgr.maybe_save(3, force=True)
    with CheckpointManager(tmp_path, {"t": t}, every_n_steps=3) as mgr:  # a new manager sees it too
        with pytest.raises(StepAlreadyExistsError):
            mgr.maybe_save(3)
    assert load(tmp_path)["t"].tolist() == [1.0, 1.0]
    with CheckpointManager(tmp_path, {"t": t}, overwrite=True) as mgr:
        assert mgr.maybe_save(3, force=True)
        mgr.wait()
        assert mgr.steps() == [3]
    assert load(tmp_path)["t"].tolist() == [5.0, 5.0]


def test_every_n_seconds_real_clock(tmp_path):
    with CheckpointManager(tmp_path, {"t": torch.ones(1)}, every_n_seconds=0.5, keep_last=None) as mgr:
        assert mgr.maybe_save(0) is False  # counts from construction
        time.sleep(0.55)
        assert mgr.maybe_save(1) is True
        assert mgr.maybe_save(2) is False  # counts from the last save
        time.sleep(0.55)
        assert mgr.maybe_save(3) is True
        mgr.wait()
        assert mgr.steps() == [1, 3]


def test_at_steps_every_n_steps_and_force(tmp_path):
    with CheckpointManager(tmp_path, {"t": torch.ones(1)}, every_n_steps=4, at_steps=[1, 6], keep_last=None) as mgr:
        started = [s for s in range(10) if mgr.maybe_save(s)]
        assert started == [0, 1, 4, 6, 8]
        assert mgr.maybe_save(9, force=True)
        mgr.wait()
        assert mgr.steps() == [0, 1, 4, 6, 8, 9]
        assert mgr.latest_step() == 9


def test_no_schedule_saves_only_when_forced(tmp_path):
    with CheckpointManager(tmp_path, {"t": torch.ones(1)}) as mgr:
        assert not any(mgr.maybe_save(s) for s in range(5))
        mgr.wait()
        assert mgr.steps() == [] and mgr.latest_step() is None
        mgr.save(7)
        mgr.wait()
        assert mgr.steps() == [7]


def test_stats_keys_and_values(tmp_path):
    with CheckpointManager(tmp_path, {"t": torch.arange(10_000.0)}, keep_last=None, compression="zstd") as mgr:
        before = mgr.stats()
        assert before["saves_started"] == 0 and before["last_committed_step"] is None
        mgr.save(1)
        mgr.save(2)
        mgr.wait()
        stats = mgr.stats()
    for key in ("saves_started", "saves_committed", "saves_failed", "saves_pending", "last_committed_step",
                "snapshot_secs_last", "snapshot_secs_total", "bytes_written_total", "raw_bytes_total",
                "compression_ratio", "codec", "last_save"):
        assert key in stats, key
    assert stats["saves_started"] == 2 and stats["saves_committed"] == 2 and stats["saves_failed"] == 0
    assert stats["saves_pending"] == 0 and stats["last_committed_step"] == 2
    assert stats["codec"] == "zstd"
    assert stats["raw_bytes_total"] > 2 * 40_000 and stats["bytes_written_total"] > 0
    assert stats["compression_ratio"] == pytest.approx(stats["raw_bytes_total"] / stats["bytes_written_total"])
    on_disk = sum(p.stat().st_size for p in (tmp_path / "step-000000002").iterdir() if ".pt" in p.name)
    assert stats["last_save"]["step"] == 2 and stats["last_save"]["bytes_written"] == on_disk


def test_restore_of_an_uncommitted_step_raises(tmp_path):
    with CheckpointManager(tmp_path, {"t": torch.ones(1)}) as mgr:
        mgr.save(1)
        with pytest.raises(CheckpointNotFoundError, match="step 2"):
            mgr.restore(2)
        (tmp_path / "step-000000005").mkdir()
        with pytest.raises(CheckpointNotFoundError):
            mgr.restore(5)
        assert mgr.steps() == [1]


def test_restore_in_place_keeps_live_objects_dtype_and_format(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Conv2d(2, 4, 3).to(memory_format=torch.channels_last)
    buf = torch.arange(6, dtype=torch.float64)
    data = {"a": [1, 2], "b": "x"}
    items = [1, "two"]
    with CheckpointManager(tmp_path, {"model": model, "buf": buf, "data": data, "items": items}) as mgr:
        mgr.save(0)
    saved_w = model.weight.detach().clone()

    model2 = torch.nn.Conv2d(2, 4, 3).to(memory_format=torch.channels_last)
    weight_obj = model2.weight
    buf2 = torch.zeros(6, dtype=torch.float64)
    data2 = {"stale": True}
    items2 = ["stale"]
    with CheckpointManager(tmp_path, {"model": model2, "buf": buf2, "data": data2, "items": items2}) as mgr:
        assert mgr.restore_latest() == 0
    assert model2.weight is weight_obj and torch.equal(model2.weight, saved_w)
    assert model2.weight.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(buf2, buf) and buf2.dtype == torch.float64
    assert data2 == {"a": [1, 2], "b": "x"}
    assert items2 == [1, "two"]


def test_restore_into_mismatched_state_raises_before_touching_anything(tmp_path):
    with CheckpointManager(tmp_path, {"model": torch.nn.Linear(2, 3), "extra": {"k": 1}}) as mgr:
        mgr.save(0)
    live = torch.nn.Linear(2, 4)
    extra = {"k": 0}
    before = live.weight.detach().clone()
    with CheckpointManager(tmp_path, {"model": live, "extra": extra}) as mgr:
        with pytest.raises(checkpointd.StateMismatchError, match="model"):
            mgr.restore(0)
    assert torch.equal(live.weight, before) and extra == {"k": 0}
    with CheckpointManager(tmp_path, {"other": torch.nn.Linear(2, 3)}) as mgr:
        with pytest.raises(checkpointd.StateMismatchError, match="other"):
            mgr.restore_latest()


def test_max_pending_backpressure_keeps_order(tmp_path):
    plan = FaultPlan(Fault(op="open", error=None, delay_secs=0.05, path="*step-*"))
    t = torch.zeros(1)
    with CheckpointManager(f"faulty://{tmp_path}", {"t": t}, keep_last=None, max_pending=2,
                           storage_options={"target_protocol": "file", "faults": plan}) as mgr:
        for s in range(5):
            t.fill_(s)
            mgr.save(s)
            assert mgr.stats()["saves_pending"] <= 2
        mgr.wait()
        assert mgr.steps() == [0, 1, 2, 3, 4]
    for s in range(5):
        assert load(tmp_path, step=s)["t"].item() == s


def test_restore_into_an_optimizer_over_other_parameters_raises_before_touching_anything(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    with CheckpointManager(tmp_path, {"model": model, "optimizer": opt}) as mgr:
        mgr.save(1)
    live = torch.nn.Linear(3, 2)
    before = live.weight.detach().clone()
    live_opt = torch.optim.Adam([live.weight])  # the bias is missing
    with CheckpointManager(tmp_path, {"model": live, "optimizer": live_opt}) as mgr:
        with pytest.raises(checkpointd.StateMismatchError, match="optimizer"):
            mgr.restore_latest()
    assert torch.equal(live.weight, before) and not live_opt.state


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_sharded_mode_in_one_process_saves_full_files_that_restore(tmp_path, compression):
    """``mode`` matters only under torch.distributed: one process with mode="sharded" writes full-mode
    files, which restore_latest() and load() read back bit-exactly."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with CheckpointManager(tmp_path, {"model": model, "optim": opt}, mode="sharded", compression=compression) as mgr:
        mgr.save(3)
    manifest = json.loads((tmp_path / "step-000000003" / "manifest.json").read_text())
    assert manifest["mode"] == "full"
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    with CheckpointManager(tmp_path, {"model": model, "optim": opt}, mode="sharded", compression=compression) as mgr:
        assert mgr.restore_latest() == 3
    for k, v in model.state_dict().items():
        assert torch.equal(v, saved[k]), k
    assert torch.equal(load(tmp_path)["model"]["weight"], saved["weight"])
