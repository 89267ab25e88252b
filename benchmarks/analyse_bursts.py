"""How often the steps after a checkpoint's copies carry a burst, by host and method, over stored stall runs.

Why: device staging's stall (target 20 ms) is missed in runs where one checkpoint of three draws a
burst of 20-76 ms in the steps while its files are written. This asks of every stored
``bench_stall.py`` JSON whether such bursts belong to the library or to writing files on the host: for
each checkpoint window, the steps ``+FROM..+20`` after the save step are summed against the median step
of the run's first ``none`` run and counted when above ``--above`` ms. Runs without checkpoints are
scored at the same offsets (every ``every`` steps) as a placebo. ``copy_only`` copies without writing,
``io_only``/``io_only_reuse`` write without any library code in the training process.

    python benchmarks/analyse_bursts.py [--gb 4.83] [--above 20] [--from-step 6] [JSON or directory ...]

Defaults: every JSON under ``benchmarks/results``. Prints one table by card and method, then device
staging's first checkpoints against its later ones (RESULTS.md, session 16).
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import statistics
import sys
from typing import Any, Iterator

HERE = os.path.dirname(os.path.abspath(__file__))
METHODS = ("none", "copy_only", "io_only", "io_only_reuse", "checkpointd", "checkpointd_device")


def base_method(name: str) -> str:
    """``checkpointd_device#2`` and ``checkpointd_device@ENV=1`` count as ``checkpointd_device``."""
    return name.split("#")[0].split("@")[0]


def windows(run: dict, every: int) -> list[int]:
    """Indices of the save steps of ``run`` (for a ``none`` run: where the saves would have been)."""
    n = len(run.get("step_s") or [])
    if base_method(run.get("method", "")) == "none":
        return [k * every - 1 for k in range(1, n // every + 1)]
    return [s - 1 for s in run.get("saves") or []]


def window_sums(res: dict, from_step: int = 6, upto: int = 20) -> Iterator[tuple[str, int, float]]:
    """``(method, checkpoint index in its run, ms)``: steps ``+from_step..+upto`` of each window, summed."""
    runs = res.get("runs")
    every = (res.get("workload") or {}).get("every")
    if not isinstance(runs, list) or not every:
        return
    none = next((r for r in runs if r.get("method") == "none" and r.get("step_s")), None)
    if none is None:
        return
    base = statistics.median(none["step_s"]) * 1e3
    for r in runs:
        method = base_method(r.get("method", ""))
        steps = [s * 1e3 for s in r.get("step_s") or []]
        for k, i in enumerate(windows(r, every)):
            if i + upto < len(steps):
                yield method, k, sum(steps[i + j] - base for j in range(from_step, upto + 1))


def card(res: dict) -> str:
    device = str((res.get("info") or {}).get("device", ""))
    return "H100" if "H100" in device else "H200" if "H200" in device else device or "?"


def stall_jsons(paths: list[str]) -> Iterator[tuple[str, dict]]:
    """Single-GPU stall results among ``paths`` (files or directories, searched recursively)."""
    files: list[str] = []
    for p in paths:
        files += sorted(glob.glob(os.path.join(p, "**", "*.json"), recursive=True)) if os.path.isdir(p) else [p]
    for f in files:
        try:
            with open(f) as fh:
                res = json.load(fh)
        except (OSError, ValueError):
            continue
        if isinstance(res, dict) and isinstance(res.get("runs"), list) and "state_bytes" in (res.get("workload") or {}):
            yield f, res


def tally(paths: list[str], gb: float, above: float, from_step: int) -> dict[str, Any]:
    """Counts of windows above ``above`` ms by (card, method), and device staging's first vs later."""
    counts: dict[tuple[str, str], list[int]] = collections.defaultdict(lambda: [0, 0])
    device: dict[str, list[int]] = {"first": [0, 0], "later": [0, 0]}
    for _, res in stall_jsons(paths):
        state_gb = res["workload"]["state_bytes"] / 1e9
        if abs(state_gb - gb) > 0.15 * gb:
            continue
        host = card(res)
        for method, k, ms in window_sums(res, from_step):
            if method not in METHODS:
                continue
            c = counts[(host, method)]
            c[0] += 1
            c[1] += ms > above
            if method == "checkpointd_device":
                d = device["first" if k == 0 else "later"]
                d[0] += 1
                d[1] += ms > above
    return {"counts": {f"{h} {m}": v for (h, m), v in sorted(counts.items())}, "device_first_later": device}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("paths", nargs="*", default=[os.path.join(HERE, "results")])
    p.add_argument("--gb", type=float, default=4.83, help="state size of the runs to count (within 15 %%)")
    p.add_argument("--above", type=float, default=20.0, help="a window counts when its steps sum above this, ms")
    p.add_argument("--from-step", type=int, default=6, help="first step after the save step that is summed")
    args = p.parse_args(argv)
    t = tally(args.paths, args.gb, args.above, args.from_step)
    print(f"windows whose steps +{args.from_step}..+20 sum above {args.above:g} ms ({args.gb:g} GB runs; "
          "`none`: runs without checkpoints at the same offsets)")
    print(f"{'card method':32s} {'windows':>8s} {'above':>6s} {'share':>7s}")
    for key, (n, hit) in t["counts"].items():
        print(f"{key:32s} {n:8d} {hit:6d} {100 * hit / n:6.1f}%")
    for key, (n, hit) in t["device_first_later"].items():
        if n:
            print(f"checkpointd_device, {key} checkpoints: {hit} of {n} ({100 * hit / n:.1f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
