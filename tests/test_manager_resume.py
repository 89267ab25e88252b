"""Bit-exact resume across processes (SPEC §2 "What a restore gives back").

Three kinds of process run ``tests/resume_worker.py``: a reference run that trains N steps without
checkpointing, an interrupted run that trains K < N steps with saves and then exits (normal close, or
``os._exit`` right after ``wait()``, like a kill), and a fresh process that ``restore_latest()``s and
continues to N. The resumed run's final state must be ``torch.equal`` to the reference's, down to the
optimizer state's channels_last strides and the next draw of every RNG.

Every run is a child of the session's forkserver (``dist_harness.FORKSERVER_PRELOAD``: torch and
checkpointd imported once, no run's state), not a new interpreter that would spend seconds importing
torch. The children are started in waves (the reference run and all interrupted runs in parallel,
then all resumed runs) to keep the wall time low on two cores; the parent enforces the deadline.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from tree_compare import assert_tree_equal

import dist_harness
import resume_worker

STEPS, STOP_AFTER, EVERY = 8, 5, 2
LAST_SAVED = STOP_AFTER - STOP_AFTER % EVERY  # the newest step the interrupted run committed

# (optimizer, compression, how the interrupted run ends)
VARIANTS = [
    ("sgd", "zstd", "kill"),
    ("adam", "zstd", "kill"),
    ("adamw_fused", "zstd", "kill"),
    ("adamw_foreach", "zstd", "kill"),
    ("adam", "none", "close"),
    ("adamw_fused", "none", "close"),
]


def _vid(v: tuple[str, str, str]) -> str:
    return "-".join(v)


def _run_all(runs: list[tuple[list[str], int]], logs: Path, timeout: float = 120) -> None:
    """Run ``resume_worker.main(argv)`` for every ``(argv, expected exit code)`` in parallel, each in a
    forkserver child; fail with the logs of the runs that exited otherwise or outlived ``timeout``."""
    ctx = dist_harness.forkserver_context()
    logs.mkdir(parents=True, exist_ok=True)
    procs = []
    for i, (argv, _) in enumerate(runs):
        log = logs / f"{i}-{argv[0]}.log"
        proc = ctx.Process(target=resume_worker.forked_main, args=(argv, str(log)), daemon=True)
        proc.start()
        procs.append((proc, log))
    end = time.monotonic() + timeout
    for proc, _ in procs:
        proc.join(max(0.0, end - time.monotonic()))
    failures = []
    for (argv, want), (proc, log) in zip(runs, procs):
        if proc.is_alive():
            proc.kill()
            proc.join(10)
            why = f"still running after {timeout:.0f} s (killed)"
        elif proc.exitcode != want:
            why = f"exited {proc.exitcode}, expected {want}"
        else:
            continue
        out = log.read_text(errors="replace")[-3000:] if log.exists() else ""
        failures.append(f"{' '.join(argv)}: {why}:\n{out}")
    assert not failures, "\n\n".join(failures)


@pytest.fixture(scope="module")
def resume_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("resume")
    ref_out = base / "reference"
    opts = sorted({v[0] for v in VARIANTS})
    common = ["--steps", str(STEPS), "--stop-after", str(STOP_AFTER), "--every", str(EVERY)]
    reference = (["reference", "--opt", *opts, "--out", str(ref_out), *common], 0)
    interrupts, resumes, outs = [], [], {}
    for v in VARIANTS:
        opt, comp, how = v
        root = base / _vid(v) / "ckpt"
        out = base / _vid(v) / "out"
        interrupts.append((["interrupt", "--opt", opt, "--root", str(root), "--out", str(out),
                            "--compression", comp, "--exit", how, *common],
                           resume_worker.KILLED_EXIT_CODE if how == "kill" else 0))
        resumes.append((["resume", "--opt", opt, "--root", str(root), "--out", str(out),
                         "--compression", comp, "--expect-restored", str(LAST_SAVED), *common], 0))
        outs[_vid(v)] = out / f"{opt}.pt"
    _run_all([reference, *interrupts], base / "logs")
    for v in VARIANTS:  # the interrupted runs left exactly what they committed
        root = base / _vid(v) / "ckpt"
        # (a killed run also leaves its lease on the root: the restarted job takes it over at once)
        names = sorted(p.name for p in root.iterdir() if not p.name.startswith(".checkpointd-lease"))
        assert names == [f"step-{s:09d}" for s in (2, 4)], _vid(v)
    _run_all(resumes, base / "logs")
    outs["reference"] = ref_out
    return outs


@pytest.mark.parametrize("variant", VARIANTS, ids=_vid)
def test_resume_is_bit_exact(resume_runs: dict[str, Path], variant: tuple[str, str, str]) -> None:
    opt = variant[0]
    ref = torch.load(resume_runs["reference"] / f"{opt}.pt", weights_only=True)
    got = torch.load(resume_runs[_vid(variant)], weights_only=True)
    # The resumed process trained exactly the steps after the last commit.
    assert len(got["losses"]) == STEPS - LAST_SAVED
    assert got["losses"] == ref["losses"][LAST_SAVED:]
    for key in ("model", "param_strides", "opt", "sched", "scaler", "next_draws"):
        assert_tree_equal(ref[key], got[key], key)
    # Optimizer state the optimizer actually computes with keeps the parameters' layout.
    assert_tree_equal(ref["opt_live_strides"], got["opt_live_strides"], "opt_live_strides")
    conv_w = "0"  # the conv weight is the first parameter
    state_keys = [k for k in got["opt_live_strides"] if k.startswith(conv_w + ".") and k != "0.step"]
    assert state_keys, "the optimizer keeps per-parameter state for the conv weight"
    for k in state_keys:
        assert got["opt_live_strides"][k] == got["param_strides"]["conv.weight"], k


def test_reference_runs_differ_per_optimizer(resume_runs: dict[str, Path]) -> None:
    """Guard against a vacuous comparison: the runs really train (and differ by optimizer)."""
    sgd = torch.load(resume_runs["reference"] / "sgd.pt", weights_only=True)
    adam = torch.load(resume_runs["reference"] / "adam.pt", weights_only=True)
    assert not torch.equal(sgd["model"]["conv.weight"], adam["model"]["conv.weight"])
    assert sgd["model"]["bn.num_batches_tracked"].item() == STEPS
    assert sgd["param_strides"]["conv.weight"] == (27, 1, 9, 3)  # channels_last
    assert sgd["scaler"]["scale"] > 2.0**10  # the scale grew: the scaler state really changes
