"""Errors (SPEC §2 "Errors"): bad state raises from ``maybe_save`` (or the constructor) and writes
nothing; a background failure surfaces as ``CheckpointWriteError`` naming the step and chaining the
cause, older checkpoints stay intact, and the manager keeps working once storage is back.
"""

from __future__ import annotations

import errno
import time
from collections import OrderedDict

import pytest
import torch

import checkpointd
from checkpointd import CheckpointError, CheckpointManager, CheckpointWriteError, ConfigError, IOOptions, load
from checkpointd.testing.faults import Fault, FaultPlan, permanent_error


class _Opaque:
    pass


class _IntKeyModule(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)

    def state_dict(self, *args, **kwargs):  # type: ignore[override]
        sd = super().state_dict(*args, **kwargs)
        sd[7] = torch.zeros(1)
        return sd


def _step_dirs(root) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) if root.exists() else []


@pytest.mark.parametrize(
    "make_state, needle",
    [
        (lambda: {"cfg": {"fn": lambda x: x}}, r"state\['cfg'\]\['fn'\]"),
        (lambda: {"cfg": {"obj": _Opaque()}}, r"state\['cfg'\]\['obj'\].*_Opaque"),
        (lambda: {"items": [1, {"deep": [object()]}]}, r"state\['items'\]\[1\]\['deep'\]\[0\]"),
        (lambda: {"model": torch.nn.Linear(2, 2, device="meta")}, r"state\['model'\]\['weight'\].*meta"),
        (lambda: {"model": _IntKeyModule()}, r"state\['model'\].*non-string key 7"),
        (lambda: {"cfg": {"a": {object(): 1}}}, r"state\['cfg'\]\['a'\].*object"),
        (lambda: {"t": torch.zeros(3).to_sparse()}, r"state\['t'\].*layout"),
    ],
    ids=["lambda", "custom-class", "nested-object", "meta-tensor", "module-int-key", "object-key", "sparse"],
)
def test_bad_state_raises_from_maybe_save_and_writes_nothing(tmp_path, make_state, needle):
    state = make_state()
    state["good"] = torch.ones(2)
    mgr = CheckpointManager(tmp_path, state, every_n_steps=1)
    with pytest.raises(checkpointd.StateError, match=needle) as info:
        mgr.maybe_save(1)
    assert isinstance(info.value, CheckpointError)
    mgr.wait()
    assert _step_dirs(tmp_path) == []
    assert mgr.steps() == []
    with pytest.raises(checkpointd.StateError):  # force=True takes the same checks
        mgr.save(2)
    mgr.close()
    assert _step_dirs(tmp_path) == []


def test_bad_state_fixed_later_saves(tmp_path):
    cfg = {"fn": lambda: 0}
    with CheckpointManager(tmp_path, {"cfg": cfg}) as mgr:
        with pytest.raises(checkpointd.StateError):
            mgr.save(1)
        cfg["fn"] = "fixed"
        mgr.save(1)
    assert load(tmp_path)["cfg"] == {"fn": "fixed"}


def test_bad_metrics_raise_from_maybe_save(tmp_path):
    with CheckpointManager(tmp_path, {"t": torch.zeros(1)}) as mgr:
        with pytest.raises(checkpointd.StateError, match="metrics"):
            mgr.save(1, metrics={1: 0.5})
        with pytest.raises(checkpointd.StateError, match="loss"):
            mgr.save(1, metrics={"loss": torch.ones(3)})
        with pytest.raises(checkpointd.StateError, match="loss"):
            mgr.save(1, metrics={"loss": [1.0]})
    assert _step_dirs(tmp_path) == []


@pytest.mark.parametrize("key", [1, None, ("a",), ""])
def test_non_string_top_level_key_raises_at_construction(tmp_path, key):
    with pytest.raises(checkpointd.StateError, match="string"):
        CheckpointManager(tmp_path, {key: torch.zeros(1)})
    assert _step_dirs(tmp_path) == []


@pytest.mark.parametrize("obj", [3, 2.5, "text", (1, 2), {1, 2}, _Opaque(), None])
def test_unsupported_object_raises_at_construction(tmp_path, obj):
    with pytest.raises(checkpointd.StateError, match="state\\['x'\\]"):
        CheckpointManager(tmp_path, {"x": obj})


def test_state_must_be_a_mapping(tmp_path):
    with pytest.raises(CheckpointError):
        CheckpointManager(tmp_path, [torch.zeros(1)])


@pytest.mark.parametrize("name", ["epoch", "metadata", "optimizer_state_dict", "scheduler_state_dict"])
def test_reserved_name_collision_is_a_config_error(tmp_path, name):
    with pytest.raises(ConfigError, match=name):
        CheckpointManager(tmp_path, {name: {"a": 1}})


def test_reserved_role_names_for_their_own_role_are_fine(tmp_path):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with CheckpointManager(tmp_path, {"model": model, "optimizer_state_dict": opt}) as mgr:
        mgr.save(0)
    assert set(load(tmp_path)) == {"model", "optimizer_state_dict"}


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(every_n_steps=0),
        dict(every_n_seconds=-1),
        dict(keep_last=0),
        dict(keep_best=1),
        dict(best_mode="median", keep_best=1, best_metric="m"),
        dict(mode="zero"),
        dict(max_pending=0),
        dict(compression="gzip-9000"),
        dict(at_steps=["x"]),
    ],
)
def test_bad_options_are_config_errors(tmp_path, kwargs):
    with pytest.raises(ConfigError):
        CheckpointManager(tmp_path, {"t": torch.zeros(1)}, **kwargs)


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: checkpointd.StagingOptions(device_budget_bytes=-1), "device_budget_bytes"),
        (lambda: checkpointd.StagingOptions(host_budget_bytes=0), "host_budget_bytes"),
        (lambda: checkpointd.StagingOptions(host_budget_bytes=True), "host_budget_bytes"),
        (lambda: checkpointd.StagingOptions(freeze_gc="yes"), "freeze_gc"),
        (lambda: IOOptions(file_threads=0), "file_threads"),
        (lambda: IOOptions(retry_timeout_secs=-1), "retry_timeout_secs"),
        (lambda: IOOptions(lease_timeout_secs=0), "lease_timeout_secs"),
        (lambda: checkpointd.DistributedOptions(timeout_secs="10"), "timeout_secs"),
    ],
)
def test_bad_option_groups_name_the_field(make, field):
    with pytest.raises(ConfigError, match=field):
        make()


def test_option_groups_are_frozen_and_only_taken_as_groups(tmp_path):
    io = IOOptions(retry_timeout_secs=5)
    with pytest.raises(AttributeError):
        io.retry_timeout_secs = 6  # type: ignore[misc]
    with pytest.raises(ConfigError, match="io must be a checkpointd.IOOptions"):
        CheckpointManager(tmp_path, {"t": torch.zeros(1)}, io={"retry_timeout_secs": 5})
    with pytest.raises(TypeError):
        CheckpointManager(tmp_path, {"t": torch.zeros(1)}, retry_timeout_secs=5)  # a field of IOOptions, not an argument


def test_bad_step_argument(tmp_path):
    with CheckpointManager(tmp_path, {"t": torch.zeros(1)}) as mgr:
        for bad in (-1, 1.0, "3", True):
            with pytest.raises(CheckpointError):
                mgr.maybe_save(bad, force=True)


def test_root_that_is_a_file_is_a_config_error(tmp_path):
    f = tmp_path / "file"
    f.write_bytes(b"x")
    with pytest.raises(ConfigError):
        CheckpointManager(f, {"t": torch.zeros(1)})


# -- background failures ----------------------------------------------------------------------------
def _faulty(tmp_path, plan, **kwargs):
    t = torch.zeros(4)
    mgr = CheckpointManager(f"faulty://{tmp_path}", {"t": t}, io=IOOptions(retry_timeout_secs=0.3),
                            storage_options={"target_protocol": "file", "faults": plan}, **kwargs)
    return mgr, t


def _eio(op, path):
    return OSError(errno.EIO, f"injected I/O error on {op} {path}")


@pytest.mark.parametrize(
    "fault",
    [
        Fault(op="open", path="*step-000000002/*", error=permanent_error),
        Fault(op="write", path="*step-000000002/*", error=_eio),
        Fault(op="close", path="*step-000000002/COMMITTED", error=permanent_error),
        Fault(op="close", path="*step-000000002/manifest.json", error=_eio),
    ],
    ids=["open-eacces", "write-eio", "marker-eacces", "manifest-eio"],
)
def test_background_failure_surfaces_on_wait(tmp_path, fault):
    plan = FaultPlan()
    mgr, t = _faulty(tmp_path, plan)
    t.fill_(1)
    mgr.save(1)
    mgr.wait()
    plan.add(fault)
    t.fill_(2)
    assert mgr.maybe_save(2, force=True)  # the failure happens in the background, not here
    with pytest.raises(CheckpointWriteError, match="step 2") as info:
        mgr.wait()
    err = info.value
    assert err.step == 2
    assert isinstance(err.__cause__, OSError)
    assert plan.failures(), "the fault fired"
    mgr.wait()  # reported once
    assert mgr.steps() == [1]
    assert not (tmp_path / "step-000000002" / "COMMITTED").exists()
    assert mgr.stats()["saves_failed"] == 1

    plan.clear()  # storage is back
    t.fill_(3)
    mgr.save(3)
    mgr.wait()
    assert mgr.steps() == [1, 3]
    mgr.close()
    assert load(tmp_path, step=1)["t"][0].item() == 1
    assert load(tmp_path)["t"][0].item() == 3


def test_background_failure_surfaces_on_next_maybe_save(tmp_path):
    plan = FaultPlan(Fault(op="open", path="*step-000000001/*", error=permanent_error))
    mgr, t = _faulty(tmp_path, plan)
    mgr.save(1)
    deadline = time.monotonic() + 10
    while mgr.stats()["saves_pending"] and time.monotonic() < deadline:  # stats() never raises
        time.sleep(0.02)
    with pytest.raises(CheckpointWriteError, match="step 1"):
        mgr.maybe_save(2, force=True)
    assert mgr.maybe_save(2, force=True)
    mgr.close()
    assert load(tmp_path)["t"].shape == (4,)


def test_background_failure_surfaces_on_close(tmp_path):
    plan = FaultPlan(Fault(op="write", path="*step-000000001/*", error=permanent_error))
    mgr, _ = _faulty(tmp_path, plan)
    mgr.save(1)
    with pytest.raises(CheckpointWriteError) as info:
        mgr.close()
    assert info.value.step == 1
    assert isinstance(info.value.__cause__, PermissionError)


def test_transient_failure_is_retried_and_commits(tmp_path):
    plan = FaultPlan(Fault(op="write", path="*step-000000001/*", times=1))  # one connection reset
    mgr, t = _faulty(tmp_path, plan)
    t.fill_(7)
    mgr.save(1)
    mgr.wait()
    mgr.close()
    assert len(plan.failures()) == 1
    assert load(tmp_path)["t"][0].item() == 7


def test_disk_full_surfaces_and_recovers(tmp_path):
    plan = FaultPlan()
    mgr, t = _faulty(tmp_path, plan)
    mgr.save(1)
    mgr.wait()
    plan.free_disk(capacity_bytes=100)
    t.fill_(2)
    mgr.save(2)
    with pytest.raises(CheckpointWriteError) as info:
        mgr.wait()
    assert getattr(info.value.__cause__, "errno", None) == errno.ENOSPC
    assert mgr.steps() == [1]
    plan.disk_capacity_bytes = None  # space is back
    plan.free_disk()
    mgr.save(3)
    mgr.close()
    assert sorted(p.name for p in tmp_path.iterdir() if (p / "COMMITTED").exists()) == [
        "step-000000001", "step-000000003"]


def test_ordered_dict_module_state_roundtrip_keeps_order(tmp_path):
    model = torch.nn.Sequential(OrderedDict([("b", torch.nn.Linear(2, 2)), ("a", torch.nn.Linear(2, 2))]))
    with CheckpointManager(tmp_path, {"model": model}) as mgr:
        mgr.save(0)
    assert list(load(tmp_path)["model"]) == list(model.state_dict())
