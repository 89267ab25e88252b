"""Deterministic training run for the bit-exact resume tests (``tests/test_manager_resume.py``).

Runs in a fresh process, one per phase: as a script, or as a child of the test session's forkserver
(:func:`forked_main`: torch and checkpointd already imported, no training state):

    reference  train steps 1..N without any checkpointing (one run per optimizer given)
    interrupt  train steps 1..K, saving every ``--every`` steps; then either close() normally or
               wait() and ``os._exit(KILLED_EXIT_CODE)`` without close (a kill after the last commit)
    resume     build everything afresh, ``restore_latest()``, continue to N (saving as before)

Each phase that finishes writes ``<out>/<optimizer>.pt``: parameters, buffers, optimizer, scheduler and
GradScaler state, the strides of every optimizer state tensor, and the next draws of every RNG, so the
test can compare the resumed run with the reference bit for bit.

The loop draws from every RNG a training script may use (torch inputs, dropout, ``random``, NumPy),
so a checkpoint that does not restore RNG state resumes into different data and fails the test.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
from pathlib import Path

import numpy as np
import torch

_SRC = Path(__file__).resolve().parent.parent / "src"
if str(_SRC) not in sys.path:
    sys.path.insert(0, str(_SRC))

from checkpointd import CheckpointManager  # noqa: E402

OPTIMIZERS = ("sgd", "adam", "adamw_fused", "adamw_foreach")
KILLED_EXIT_CODE = 86
"""The exit status of an interrupted run that ended with ``os._exit`` (no close, no interpreter shutdown):
the parent tells it from a run that returned normally."""


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(4)
        self.drop = torch.nn.Dropout(0.25)
        self.fc = torch.nn.Linear(4 * 6 * 6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.bn(self.conv(x))))
        return self.fc(h.flatten(1))


def build(opt_name: str):
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    model = Net().to(memory_format=torch.channels_last)
    assert model.conv.weight.is_contiguous(memory_format=torch.channels_last)
    params = model.parameters()
    if opt_name == "sgd":
        opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    elif opt_name == "adam":
        opt = torch.optim.Adam(params, lr=0.01)
    elif opt_name == "adamw_fused":
        opt = torch.optim.AdamW(params, lr=0.01, fused=True)
    elif opt_name == "adamw_foreach":
        opt = torch.optim.AdamW(params, lr=0.01, foreach=True)
    else:
        raise SystemExit(f"unknown optimizer {opt_name}")
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    assert scaler.is_enabled()
    return model, opt, sched, scaler


def train_step(model, opt, sched, scaler) -> float:
    model.train()
    x = torch.randn(4, 3, 6, 6).to(memory_format=torch.channels_last)
    target = torch.randn(4, 3) * random.random() + float(np.random.rand())
    loss = torch.nn.functional.mse_loss(model(x), target)
    opt.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    sched.step()
    return float(loss.detach())


def dump(path: Path, model, opt, sched, scaler, losses: list[float]) -> None:
    opt_sd = opt.state_dict()
    strides = {
        f"{pid}.{k}": tuple(v.stride())
        for pid, st in opt.state_dict()["state"].items()
        for k, v in st.items()
        if isinstance(v, torch.Tensor)
    }
    # Live strides of the optimizer state (what the optimizer computes with).
    live_strides = {}
    for i, p in enumerate(model.parameters()):
        for k, v in opt.state.get(p, {}).items():
            if isinstance(v, torch.Tensor):
                live_strides[f"{i}.{k}"] = tuple(v.stride())
    torch.save(
        {
            "model": model.state_dict(),
            "param_strides": {n: tuple(p.stride()) for n, p in model.named_parameters()},
            "opt": opt_sd,
            "opt_strides": strides,
            "opt_live_strides": live_strides,
            "sched": sched.state_dict(),
            "scaler": scaler.state_dict(),
            "next_draws": {
                "torch": torch.rand(3),
                "python": random.random(),
                "numpy": float(np.random.rand()),
            },
            "losses": losses,
        },
        path,
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("phase", choices=("reference", "interrupt", "resume"))
    ap.add_argument("--opt", nargs="+", default=list(OPTIMIZERS))
    ap.add_argument("--root")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--stop-after", type=int, default=5)
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--compression", default="zstd")
    ap.add_argument("--exit", choices=("close", "kill"), default="close")
    ap.add_argument("--expect-restored", type=int)
    args = ap.parse_args(argv)

    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    compression = None if args.compression == "none" else args.compression
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    if args.phase == "reference":
        for name in args.opt:
            model, opt, sched, scaler = build(name)
            losses = [train_step(model, opt, sched, scaler) for _ in range(args.steps)]
            dump(out / f"{name}.pt", model, opt, sched, scaler, losses)
        return

    (name,) = args.opt
    model, opt, sched, scaler = build(name)
    state = {"model": model, "optimizer": opt, "scheduler": sched, "scaler": scaler}
    mgr = CheckpointManager(args.root, state, every_n_steps=args.every, compression=compression, keep_last=2)
    if args.phase == "interrupt":
        losses = []
        for step in range(1, args.stop_after + 1):
            losses.append(train_step(model, opt, sched, scaler))
            mgr.maybe_save(step, metrics={"loss": losses[-1]})
        if args.exit == "kill":
            mgr.wait()
            os._exit(KILLED_EXIT_CODE)  # no close(), no interpreter shutdown: like a SIGKILL after the last commit
        mgr.close()
        return

    restored = mgr.restore_latest()
    if restored != args.expect_restored:
        raise SystemExit(f"restore_latest() returned {restored}, expected {args.expect_restored}")
    losses = []
    for step in range(restored + 1, args.steps + 1):
        losses.append(train_step(model, opt, sched, scaler))
        mgr.maybe_save(step)
    mgr.close()
    dump(out / f"{name}.pt", model, opt, sched, scaler, losses)


def forked_main(argv: list[str], log_path: str) -> None:
    """:func:`main` in a child of a ``multiprocessing`` forkserver, its stdout and stderr (tracebacks
    included) going to ``log_path``.

    The forkserver imported torch and checkpointd and nothing else: the child is a fresh process with
    no model, optimizer, manager or RNG state of any run. Its inherited heap is frozen first (as the
    torture's children do), so the manager's full collection at construction scans only what the run
    makes.
    """
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - lives until the process exits
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    gc.freeze()
    main(argv)


if __name__ == "__main__":
    main()
