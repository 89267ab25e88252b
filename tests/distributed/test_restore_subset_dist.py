"""Partial and non-strict restores, and ``restore_from``, under torch.distributed (2 gloo ranks, FSDP2).

One scenario on both ranks: an FSDP2 model and its AdamW are saved at step 2 in full mode and in sharded
mode. Fresh ranks that registered one entry more (``progress``) then restore: strict refuses on every rank,
``strict=False`` restores everything else bit for bit (warning once, on rank 0); ``entries=["model"]``
(from either step) restores the model and keeps the live optimizer state and RNG; ``restore_from`` loads the full values on
every rank into FSDP2 parameters with a new head (``strict=False``: the body's keys, the head left).
Comparisons gather full tensors (collective) and use ``torch.equal``.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from dist_harness import assert_same_state, fsdp2_with_adamw, gathered_state, run_distributed, train_same_batches

from checkpointd import CheckpointManager, DistributedOptions, StagingOptions, StateMismatchError

FEATURES = 5


class Net(nn.Module):
    def __init__(self, classes: int = 3) -> None:
        super().__init__()
        self.a = nn.Linear(FEATURES, 7)
        self.head = nn.Linear(7, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.a(x)))


class Wide(Net):
    """The same body, a head of 4 classes (fine-tuning)."""

    def __init__(self) -> None:
        super().__init__(classes=4)


def _manager(root: str, state: dict[str, Any], mode: str = "full") -> CheckpointManager:
    return CheckpointManager(root, state, mode=mode, distributed=DistributedOptions(timeout_secs=30),
                             staging=StagingOptions(freeze_gc=False))


def _recorded(fn: Any) -> tuple[Any, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    return out, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def scenario(rank: int, world: int, base: str) -> Any:
    roots = {mode: f"{base}/{mode}" for mode in ("full", "sharded")}
    model, opt = fsdp2_with_adamw(Net, seed=0)
    train_same_batches(model, opt, 2, seed=123, features=FEATURES)
    for mode, root in roots.items():
        with _manager(root, {"model": model, "optim": opt}, mode) as mgr:
            mgr.save(2)
    saved = gathered_state(model, opt)
    out: dict[str, Any] = {"rank": rank}

    # strict=False: a run that registered `progress` since, resumed from a full-mode step
    model, opt = fsdp2_with_adamw(Net, seed=5)
    train_same_batches(model, opt, 1, seed=6, features=FEATURES)
    before = gathered_state(model, opt)
    progress = {"seen": 7}
    with _manager(roots["full"], {"model": model, "optim": opt, "progress": progress}) as mgr:
        try:
            mgr.restore_latest()
        except StateMismatchError as exc:
            out["strict_error"] = str(exc)
        out["untouched"] = gathered_state(model, opt)
        out["step"], out["warnings"] = _recorded(lambda: mgr.restore_latest(strict=False))
    out["resumed"] = gathered_state(model, opt)
    out["progress"] = dict(progress)

    # entries=["model"] from either step: the optimizer state and RNG stay the run's own
    for mode, root in roots.items():
        model, opt = fsdp2_with_adamw(Net, seed=5)
        train_same_batches(model, opt, 1, seed=6, features=FEATURES)
        torch.manual_seed(40 + rank)
        expected_draw = torch.rand(2)
        torch.manual_seed(40 + rank)
        with _manager(root, {"model": model, "optim": opt}, mode) as mgr:
            _, out[f"model_only_warnings_{mode}"] = _recorded(lambda: mgr.restore(2, entries=["model"]))
        out[f"same_draw_{mode}"] = torch.equal(torch.rand(2), expected_draw)
        out[f"model_only_{mode}"] = gathered_state(model, opt)

    # restore_from: every rank loads the full values; FSDP2 with a new head takes the body's keys
    wide, wide_opt = fsdp2_with_adamw(Wide, seed=9)
    head_before = {k: v.full_tensor().clone() for k, v in wide.head.state_dict().items()}
    with _manager(f"{base}/finetune-{rank}", {"model": wide, "optim": wide_opt}) as mgr:
        _, out["from_warnings"] = _recorded(lambda: mgr.restore_from(roots["sharded"], entries=["model"], strict=False))
        out["from_steps"] = mgr.steps()
    full = {k: v.full_tensor() for k, v in wide.state_dict().items()}  # collective
    out["body_restored"] = all(torch.equal(full[k], saved["model"][k]) for k in ("a.weight", "a.bias"))
    out["head_kept"] = all(torch.equal(full[f"head.{k}"], v) for k, v in head_before.items())
    train_same_batches(wide, wide_opt, 1, seed=3, features=FEATURES)  # training goes on from there
    if rank == 0:
        out.update(saved=saved, before=before)
    return out


def test_partial_and_non_strict_restores_on_two_ranks(tmp_path: Path) -> None:
    results = run_distributed(scenario, 2, str(tmp_path), deadline_secs=90)
    r0 = results[0]
    for r in results:
        assert "checkpoint step 2 has no entry 'progress'" in r["strict_error"], r["rank"]
        assert r["step"] == 2 and r["progress"] == {"seen": 7}
        for mode in ("full", "sharded"):
            assert r[f"model_only_warnings_{mode}"] == [] and r[f"same_draw_{mode}"], mode
        assert r["body_restored"] and r["head_kept"] and r["from_steps"] == []
    assert r0["warnings"] == ["checkpointd: step 2 has no entry 'progress'; left as it is"]
    assert results[1]["warnings"] == []  # one warning per restore: rank 0's
    assert_same_state(r0["untouched"], r0["before"])  # the strict refusal applied nothing
    assert_same_state(r0["resumed"], r0["saved"])
    for mode in ("full", "sharded"):
        got = r0[f"model_only_{mode}"]
        assert_same_state({"model": got["model"], "state": {}}, {"model": r0["saved"]["model"], "state": {}})
        assert_same_state({"model": {}, "state": got["state"]}, {"model": {}, "state": r0["before"]["state"]})
    (message,) = r0["from_warnings"]
    assert message.startswith("checkpointd: state['model'] (Wide): keys 'head.weight' (live (4, 7), saved (3, 7)), "
                              "'head.bias' (live (4,), saved (3,)) of another shape left as they are"), message
