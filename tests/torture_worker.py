"""Crash-consistency torture: a training process saving every step is SIGKILLed at a random moment;
then the root must restore to its newest committed step, bit-identical to the state at that step.

Used by ``tests/test_torture.py`` (>= 50 trials in CI) and ``benchmarks/torture.py`` (500+ trials).

Each trial forks a fresh child from a ``multiprocessing`` forkserver that has torch and checkpointd
already imported (a fresh interpreter per trial would spend seconds importing torch); the child freezes
the heap it inherited (``gc.freeze()``), so its manager's collection at construction scans only what
the trial made. The child restores the latest checkpoint of the shared root (so trials chain:
leftovers of the last kill are what it finds), then trains: at each step it sets every registered tensor to a value computed from the step
number alone (:func:`expected_state`), calls ``maybe_save(step)`` (every step, ``max_pending=1``) and
appends the newest step it has seen committed to a log. The parent kills it after a random delay and
checks the root:

- ``partial``: a step with a COMMITTED marker that does not verify (must be 0);
- ``lost``: a step the child saw committed that is gone although fewer than ``keep_last`` newer
  committed steps exist (retention had no reason to delete it; must be 0);
- ``wrong``: ``restore_latest()`` returned something else than the newest committed step, or values
  that are not bit-identical to ``expected_state(step)`` (must be 0).
"""

from __future__ import annotations

import dataclasses
import gc
import os
import random
import signal
import time
import warnings
from typing import Any

import torch

import dist_harness

from checkpointd import CheckpointManager, StagingOptions
from checkpointd.storage.store import Store
from checkpointd.restore.verify import verify_step
from checkpointd.format import layout
from checkpointd.storage import recyclebin

WIDTH = 64
X_NUMEL = 4096
"""Elements of the plain tensor ``x``; a trial may ask for millions (:attr:`TrialConfig.x_numel`), so its
file is large enough for the paths that only large files take: recycling retired files, blank files
made ahead, the persist process's kept mappings (``checkpointd.storage.recyclebin.MIN_RECYCLE_BYTES``)."""


def build_state(x_numel: int = X_NUMEL) -> dict[str, Any]:
    """The registered objects (values are overwritten by :func:`assign`)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()  # creates the momentum buffers
    return {"model": model, "optimizer": opt, "x": torch.zeros(x_numel), "n": torch.zeros(16, dtype=torch.int64),
            "meta": {"step": -1, "tag": ""}}


def expected_state(step: int, x_numel: int = X_NUMEL) -> dict[str, Any]:
    """Every value of the state at ``step``, from the step number alone."""
    g = torch.Generator().manual_seed(10_000 + step)
    ref = build_state()
    out: dict[str, Any] = {"params": [torch.randn(p.shape, generator=g) for p in ref["model"].parameters()]}
    out["momentum"] = [torch.randn(p.shape, generator=g) for p in ref["model"].parameters()]
    out["x"] = torch.randn(x_numel, generator=g)
    out["n"] = torch.randint(-2**40, 2**40, (16,), generator=g)
    out["meta"] = {"step": step, "tag": f"s{step}"}
    return out


def assign(state: dict[str, Any], step: int) -> None:
    """Set the registered objects, in place, to :func:`expected_state` of ``step``."""
    exp = expected_state(step, state["x"].numel())
    with torch.no_grad():
        for p, v, m in zip(state["model"].parameters(), exp["params"], exp["momentum"]):
            p.copy_(v)
            state["optimizer"].state[p]["momentum_buffer"].copy_(m)
    state["x"].copy_(exp["x"])
    state["n"].copy_(exp["n"])
    state["meta"].clear()
    state["meta"].update(exp["meta"])


def mismatches(state: dict[str, Any], step: int) -> list[str]:
    """Names of the values of ``state`` that are not bit-identical to ``expected_state(step)``."""
    exp = expected_state(step, state["x"].numel())
    bad = []
    for i, (p, v, m) in enumerate(zip(state["model"].parameters(), exp["params"], exp["momentum"])):
        if not torch.equal(p.detach(), v):
            bad.append(f"param {i}")
        if not torch.equal(state["optimizer"].state[p]["momentum_buffer"], m):
            bad.append(f"momentum {i}")
    for key in ("x", "n"):
        if not torch.equal(state[key], exp[key]):
            bad.append(key)
    if state["meta"] != exp["meta"]:
        bad.append(f"meta {state['meta']} != {exp['meta']}")
    return bad


@dataclasses.dataclass(frozen=True)
class TrialConfig:
    root: str
    log_path: str
    storage_options: dict[str, Any] | None = None
    keep_last: int = 2
    compression: str | None = "zstd"
    x_numel: int = X_NUMEL


def child_main(cfg: TrialConfig, ready: Any) -> None:
    """The training process: saves every step, and never returns (the parent SIGKILLs it)."""
    gc.freeze()  # the forkserver's heap (torch, checkpointd): the manager's collection skips it
    state = build_state(cfg.x_numel)
    fd = os.open(cfg.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    mgr = CheckpointManager(cfg.root, state, storage_options=cfg.storage_options, every_n_steps=1,
                            keep_last=cfg.keep_last, compression=cfg.compression, max_pending=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        start = mgr.restore_latest()
    step = 0 if start is None else start + 1
    ready.set()
    seen = start
    while True:
        assign(state, step)
        mgr.maybe_save(step)
        committed = mgr.stats()["last_committed_step"]
        if committed is not None and committed != seen:
            os.write(fd, f"{committed}\n".encode())
            seen = committed
        step += 1


@dataclasses.dataclass
class TrialResult:
    delay_secs: float
    latest: int | None
    committed: list[int]
    partial: list[int]
    lost: list[int]
    wrong: list[str]
    bin_files: int = 0
    """Files in the recycle bin at the kill (retired ones, blank ones made ahead)."""

    @property
    def ok(self) -> bool:
        return not (self.partial or self.lost or self.wrong)


def forkserver_context() -> Any:
    """The session's one forkserver (:data:`dist_harness.FORKSERVER_PRELOAD`: torch, checkpointd and this
    module imported once)."""
    return dist_harness.forkserver_context()


def run_trial(ctx: Any, cfg: TrialConfig, rng: random.Random, max_delay_secs: float = 0.3) -> TrialResult:
    """One child, killed with SIGKILL after a random delay, then the root checked."""
    ready = ctx.Event()
    proc = ctx.Process(target=child_main, args=(cfg, ready), daemon=True)
    proc.start()
    try:
        if not ready.wait(60):
            raise RuntimeError(f"torture child did not start (exit code {proc.exitcode})")
        delay = rng.uniform(0.0, max_delay_secs)
        time.sleep(delay)
        if not proc.is_alive():
            raise RuntimeError(f"torture child died on its own (exit code {proc.exitcode})")
    finally:
        if proc.pid is not None and proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
    return check_root(cfg, delay)


def logged_commits(log_path: str) -> set[int]:
    try:
        with open(log_path) as f:
            return {int(line) for line in f if line.strip()}
    except FileNotFoundError:
        return set()


def check_root(cfg: TrialConfig, delay: float = 0.0) -> TrialResult:
    store = Store(cfg.root, cfg.storage_options)
    bin_files = recyclebin.contents(store)[0] if store.is_local else 0  # before our manager's close() empties it
    live = build_state(cfg.x_numel)
    # a reader: no saves whose collections a frozen heap would shorten, and no full collection of the
    # caller's heap (a test runner's: about a second) per trial
    with CheckpointManager(cfg.root, live, storage_options=cfg.storage_options, keep_last=cfg.keep_last,
                           staging=StagingOptions(freeze_gc=False)) as mgr:
        committed = mgr.steps()
        reports = {s: verify_step(store, layout.step_dir_name(s)) for s in committed}
        partial = [s for s, report in reports.items() if not report.ok]
        wrong: list[str] = [f"step {s} does not verify: {reports[s].errors}" for s in partial]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            latest = mgr.restore_latest()
        if caught:
            wrong.append(f"restore_latest warned: {caught[0].message}")
        newest = committed[-1] if committed else None
        if latest != newest:
            wrong.append(f"restore_latest() returned {latest}, newest committed is {newest}")
        if latest is not None:
            bad = mismatches(live, latest)
            if bad:
                wrong.append(f"step {latest} restored with wrong values: {bad}")
    lost = sorted(s for s in logged_commits(cfg.log_path)
                  if s not in committed and sum(1 for c in committed if c > s) < cfg.keep_last)
    return TrialResult(delay_secs=delay, latest=latest, committed=committed, partial=partial, lost=lost, wrong=wrong,
                       bin_files=bin_files)
