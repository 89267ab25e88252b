"""Bad state on one rank under torch.distributed: every rank's ``maybe_save`` raises in the same call.

The rank whose state cannot be saved gets its own StateError naming the entry and key; the other ranks
get a CheckpointError (a StateError) naming that rank and its error, within a fraction of a second,
not at ``DistributedOptions.timeout_secs``. Nothing of that step is committed, and the next save commits on every
rank and restores bit-exactly. Covered in full and sharded mode: an unpicklable object and a key of
the wrong type in a stateful's ``state_dict()``, a meta tensor in a plain-data entry, a ``state_dict()``
that raises (in full mode under FSDP2, before the ranks gather), and ranks that stop agreeing on a step.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

from dist_harness import device, fsdp2_with_adamw, gathered_state, run_distributed, assert_same_state, train_same_batches

from checkpointd import CheckpointError, CheckpointManager, CheckpointWriteError, DistributedOptions, StateError

FAST_SECS = 10.0
"""A bad save must fail on every rank well within this (the coordination timeout below is 30 s)."""


class Flaky:
    """A stateful whose ``state_dict()`` goes wrong on one rank at chosen steps (``self.fault``)."""

    def __init__(self) -> None:
        self.x = torch.arange(4, dtype=torch.float32)
        self.fault: str | None = None

    def state_dict(self) -> dict[Any, Any]:
        if self.fault == "object":
            return {"x": self.x, "handle": object()}
        if self.fault == "key":
            return {"x": self.x, b"raw": 1}
        if self.fault == "raises":
            raise RuntimeError("lost connection to the parameter server")
        return {"x": self.x}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.x.copy_(sd["x"])


# step -> (what goes wrong on rank 1, text that rank 1's error must contain)
FAULTS = {
    2: ("object", "state['flaky']['handle']"),
    3: ("meta", "state['data']['w']"),
    4: ("key", "state['flaky']"),
    5: ("raises", "state['flaky']"),
}
GOOD_STEP = 6


def _attempt(mgr: CheckpointManager, step: int) -> dict[str, Any]:
    t0 = time.monotonic()
    try:
        mgr.save(step)
    except CheckpointError as exc:
        return {"error": type(exc).__name__, "state_error": isinstance(exc, StateError), "text": str(exc),
                "secs": time.monotonic() - t0}
    return {"error": None, "secs": time.monotonic() - t0}


def faults_on_rank1(rank: int, world: int, root: str, mode: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Linear(4, 3).to(device())
    flaky = Flaky()
    data = {"w": torch.ones(2), "note": "run-a"}
    out: dict[str, Any] = {"attempts": {}}
    mgr = CheckpointManager(root, {"model": model, "flaky": flaky, "data": data}, mode=mode, keep_last=None,
                            compression=None, distributed=DistributedOptions(timeout_secs=30))
    assert _attempt(mgr, 1)["error"] is None
    mgr.wait()
    for step, (fault, _) in FAULTS.items():
        if rank == 1 or world > 2 and rank == 2 and step == 5:
            flaky.fault = fault if fault != "meta" else None
            if fault == "meta":
                data["w"] = torch.empty(2, device="meta")
        out["attempts"][step] = _attempt(mgr, step)
        out.setdefault("steps_after_fault", {})[step] = mgr.steps()
        flaky.fault = None
        data["w"] = torch.ones(2)
    with torch.no_grad():
        model.weight.mul_(3.0)
    flaky.x.add_(10.0)
    data["w"] = torch.full((2,), 7.0)
    out["attempts"][GOOD_STEP] = _attempt(mgr, GOOD_STEP)
    mgr.wait()
    want = {"weight": model.weight.detach().cpu().clone(), "x": flaky.x.clone(), "w": data["w"].clone()}
    with torch.no_grad():  # scribble over everything, then restore the good step
        model.weight.zero_()
    flaky.x.zero_()
    data["w"] = torch.zeros(2)
    mgr.restore(GOOD_STEP)
    out["restored_exact"] = (torch.equal(model.weight.detach().cpu(), want["weight"]) and torch.equal(flaky.x, want["x"])
                             and torch.equal(data["w"], want["w"]))
    t0 = time.monotonic()
    mgr.close()
    out["close_secs"] = time.monotonic() - t0
    out["steps"] = mgr.steps()
    return out


def _check_fault_results(results: list[dict[str, Any]], tmp_path: Path, failing: dict[int, set[int]]) -> None:
    """``failing``: step -> the ranks whose own state is bad at that step."""
    for rank, r in enumerate(results):
        for step, (_, names) in FAULTS.items():
            a = r["attempts"][step]
            assert a["error"] is not None, (rank, step)
            assert a["secs"] < FAST_SECS, (rank, step, a["secs"])
            assert a["state_error"], (rank, step, a["text"])
            if rank in failing[step]:
                assert names in a["text"], (rank, step, a["text"])
            else:
                assert all(f"rank {b}" in a["text"] for b in failing[step]), (rank, step, a["text"])
                assert f"step {step}" in a["text"], (rank, step, a["text"])
            assert r["steps_after_fault"][step] == [1], (rank, step)
        assert r["attempts"][GOOD_STEP]["error"] is None, rank
        assert r["restored_exact"], rank
        assert r["close_secs"] < FAST_SECS, rank
        assert r["steps"] == [1, GOOD_STEP], rank
    for step in FAULTS:
        assert not (tmp_path / f"step-{step:09d}" / "COMMITTED").exists()


@pytest.mark.parametrize("mode", ["full", "sharded"])
def test_bad_state_on_one_rank_fails_the_save_on_every_rank(tmp_path: Path, mode: str) -> None:
    results = run_distributed(faults_on_rank1, 2, str(tmp_path), mode)
    _check_fault_results(results, tmp_path, {step: {1} for step in FAULTS})
    own = results[1]["attempts"][2]
    assert own["error"] == "StateError", own  # the failing rank's precise error, not the peers' summary


def test_bad_state_on_two_of_three_ranks_names_both(tmp_path: Path) -> None:
    results = run_distributed(faults_on_rank1, 3, str(tmp_path), "sharded")
    _check_fault_results(results, tmp_path, {2: {1}, 3: {1}, 4: {1}, 5: {1, 2}})


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def raises_before_gather(rank: int, world: int, root: str, mode: str) -> dict[str, Any]:
    """FSDP2: a stateful registered before the model raises on rank 1, and training goes on between saves.

    In full mode rank 0 would otherwise enter the gather of the model's DTensors while rank 1 goes on to
    the next forward's all-gather: gloo aborts the process on the mismatched collective."""
    model, opt = fsdp2_with_adamw(Net, seed=0)
    flaky = Flaky()
    out: dict[str, Any] = {}
    mgr = CheckpointManager(root, {"flaky": flaky, "model": model, "optim": opt}, mode=mode, compression=None,
                            distributed=DistributedOptions(timeout_secs=30))
    for step in (1, 2, 3):
        train_same_batches(model, opt, 1, seed=step, features=8)
        flaky.fault = "raises" if rank == 1 and step == 2 else None
        out[step] = _attempt(mgr, step)
        mgr.wait()
    want = gathered_state(model, opt)
    train_same_batches(model, opt, 2, seed=9, features=8)
    mgr.restore(3)
    assert_same_state(gathered_state(model, opt), want)
    mgr.close()
    out["steps"] = mgr.steps()
    return out


@pytest.mark.parametrize("mode", ["full", "sharded"])
def test_state_dict_raising_before_the_gather_fails_every_rank(tmp_path: Path, mode: str) -> None:
    results = run_distributed(raises_before_gather, 2, str(tmp_path), mode)
    for rank, r in enumerate(results):
        assert r[1]["error"] is None and r[3]["error"] is None, (rank, r)
        a = r[2]
        assert a["state_error"] and a["secs"] < FAST_SECS, (rank, a)
        assert "state['flaky']" in a["text"] and "lost connection to the parameter server" in a["text"], (rank, a)
        if rank == 0:
            assert "rank 1" in a["text"], a
        assert r["steps"] == [1, 3], rank


def _fail_staging_of_step_2_on_rank_1(rank: int) -> None:
    """Patch the manager's staging so that rank 1's save of step 2 raises."""
    import checkpointd.manager as manager_mod

    real = manager_mod.stage_save

    def stage_save(**kw: Any) -> Any:
        if rank == 1 and kw["step"] == 2:
            raise CheckpointError("staging buffers could not be allocated")
        return real(**kw)

    manager_mod.stage_save = stage_save


def staging_fails_on_rank1(rank: int, world: int, root: str) -> dict[str, Any]:
    """Rank 1's maybe_save raises after the ranks agreed to save (its staging fails) and, unlike the
    manager, does not hand the failure to the protocol: the protocol's own step check sees rank 0's
    step 2 beside rank 1's step 3 and commits neither, instead of step 2 with step 3's files."""
    from checkpointd.distributed.runtime import DistributedRuntime

    _fail_staging_of_step_2_on_rank_1(rank)
    DistributedRuntime.abandon = lambda self, step, error: None  # type: ignore[method-assign]  # the net alone
    errors: list[str] = []
    mgr = CheckpointManager(root, {"model": nn.Linear(4, 4).to(device())}, mode="sharded", distributed=DistributedOptions(timeout_secs=30))
    for step in (1, 2, 3):
        try:
            mgr.save(step)
        except CheckpointError as exc:
            errors.append(f"save({step}): {exc}")
    try:
        mgr.wait()
    except CheckpointWriteError as exc:
        errors.append(f"wait: {exc}")
    mgr.save(4)
    mgr.close()
    return {"errors": errors, "steps": mgr.steps()}


def test_ranks_at_different_steps_commit_nothing(tmp_path: Path) -> None:
    r0, r1 = run_distributed(staging_fails_on_rank1, 2, str(tmp_path))
    assert r0["steps"] == r1["steps"] == [1, 4]
    assert any("different steps" in e and "rank 1: step 3" in e for e in r0["errors"]), r0
    assert any("different steps" in e for e in r1["errors"]), r1
    for step in (2, 3):
        assert not (tmp_path / f"step-{step:09d}" / "COMMITTED").exists()


def staging_fails_and_abandons(rank: int, world: int, root: str) -> dict[str, Any]:
    """As above, through the manager: rank 1's staging raises, the manager hands the failure to the
    commit protocol (``DistributedRuntime.abandon``): rank 0's save of step 2 fails at once, naming it,
    and step 3 commits on both ranks."""
    _fail_staging_of_step_2_on_rank_1(rank)
    errors: list[str] = []
    mgr = CheckpointManager(root, {"model": nn.Linear(4, 4).to(device())}, mode="sharded", distributed=DistributedOptions(timeout_secs=30))
    mgr.save(1)
    t0 = time.monotonic()
    try:
        mgr.save(2)
        mgr.wait()
    except CheckpointError as exc:
        errors.append(str(exc))
    secs = time.monotonic() - t0
    mgr.save(3)
    mgr.close()
    return {"errors": errors, "secs": secs, "steps": mgr.steps()}


def test_staging_failure_handed_to_the_protocol_fails_the_step_everywhere(tmp_path: Path) -> None:
    r0, r1 = run_distributed(staging_fails_and_abandons, 2, str(tmp_path))
    assert r1["errors"] == ["staging buffers could not be allocated"]
    assert len(r0["errors"]) == 1 and "step 2" in r0["errors"][0] and "rank 1" in r0["errors"][0], r0
    assert "staging buffers could not be allocated" in r0["errors"][0], r0
    assert r0["secs"] < FAST_SECS, r0
    assert r0["steps"] == r1["steps"] == [1, 3]


def restore_into_a_different_model_on_rank1(rank: int, world: int, root: str, mode: str) -> dict[str, Any]:
    """Save a plain replicated model on every rank, then restore it where rank 1's model has another shape."""
    torch.manual_seed(0)
    saved = nn.Linear(4, 3)
    opts = dict(mode=mode, keep_last=None, distributed=DistributedOptions(timeout_secs=30))
    with CheckpointManager(root, {"model": saved}, **opts) as mgr:
        mgr.save(1)
    live = nn.Linear(4, 3) if rank == 0 else nn.Linear(4, 5)
    with torch.no_grad():
        for p in live.parameters():
            p.fill_(-1.0)
    t0 = time.monotonic()
    try:
        with CheckpointManager(root, {"model": live}, **opts) as mgr:
            mgr.restore(1)
        error = None
    except CheckpointError as exc:
        error = f"{type(exc).__name__}: {exc}"
    return {"error": error, "secs": time.monotonic() - t0,
            "untouched": all(bool((p == -1.0).all()) for p in live.parameters())}


@pytest.mark.parametrize("mode", ["full", "sharded"])
def test_a_restore_that_does_not_fit_one_rank_changes_no_rank(tmp_path: Path, mode: str) -> None:
    r0, r1 = run_distributed(restore_into_a_different_model_on_rank1, 2, str(tmp_path), mode)
    assert r1["error"] and r1["error"].startswith("StateMismatchError") and "shape" in r1["error"], r1
    assert r0["error"] and r0["error"].startswith("StateMismatchError") and "rank 1:" in r0["error"], r0
    assert "no rank restored it" in r0["error"]
    assert r0["untouched"] and r1["untouched"], "a rank applied the step although another refused it"
    assert r0["secs"] < FAST_SECS and r1["secs"] < FAST_SECS
