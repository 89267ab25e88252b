"""Session 29 probe: where a resumed job's restore (the first in its process) spends its time.

The parent builds bench_restore's state (4.83 GB on the GPU), saves it once to /dev/shm and runs
ROUNDS rounds of fresh processes, one per variant (order alternating). Each child is bench_restore's
``--cold-child`` (builds the same model, zeroes it, times one restore_latest()) with gap_probe.py's
timers, plus the bounce pool's making (``_pool``: streams; ``pinned_chunks``: page-locked chunks).
Variants: ``chunks4`` (the library: four 16 MiB bounce chunks) and ``chunks2`` (two; half the pinning).
The parent checks every child's values.

Run: python benchmarks/results/probe/s29/cold_gap_probe.py [ROUNDS] [--json out.json]
"""

from __future__ import annotations

import argparse
import io
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", ".."))
import common as C  # noqa: E402
import bench_restore as B  # noqa: E402

VARIANTS = {"chunks4": 4, "chunks2": 2}


def child(d: str, width: int, depth: int, variant: str) -> None:
    import torch
    import gap_probe as G
    from checkpointd import bulkcopy, fastload, restore, restore_apply
    import checkpointd.manager as M

    bulkcopy.BOUNCE_CHUNKS = VARIANTS[variant]
    fastload._crc_task = G.crc_task
    G.timed(restore, "read_step")
    G.timed(fastload, "read_file_verified")
    G.timed(restore_apply, "apply_entries")
    G.timed(bulkcopy, "copy_pairs")
    G.timed(bulkcopy, "_bounced_h2d")
    G.timed(bulkcopy, "_pool")
    G.timed(bulkcopy._DevicePool, "pinned_chunks")
    G.timed(torch.optim.Optimizer, "load_state_dict", "optim_load")
    G.timed(M.CheckpointManager, "_prepare_pending_buffers", "prepare_buffers")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        B.cold_child(argparse.Namespace(cold_child=d, D=width, L=depth, cpu=os.environ.get("PROBE_CPU") == "1"))
    got = json.loads(out.getvalue().strip().splitlines()[-1])
    got["marks"] = dict(G.marks)
    print(json.dumps(got), flush=True)


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        d, width, depth, variant = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
        return child(d, width, depth, variant)
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 4
    out = sys.argv[sys.argv.index("--json") + 1] if "--json" in sys.argv else None
    dev = C.Dev(cpu=os.environ.get("PROBE_CPU") == "1")  # (a CPU smoke run: PROBE_CPU=1 PROBE_GB=0.05)
    model, opt, st = C.build_train_state(float(os.environ.get("PROBE_GB", "5")), None, None, dev, on="device")
    ref = C.sample_checksums(C.state_tensors(model, opt))
    d = "/dev/shm/ckd-coldgap/ckpt"
    B.save_once(d, dev, model, opt, [t.clone() for t in C.state_tensors(model, opt)])
    del model, opt
    C.collect()
    res: dict = {v: [] for v in VARIANTS}
    for r in range(rounds):
        for v in (list(VARIANTS) if r % 2 == 0 else list(VARIANTS)[::-1]):
            time.sleep(2)
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", d, str(st["D"]), str(st["L"]), v],
                                  capture_output=True, text=True, timeout=300)
            if proc.returncode != 0:
                raise RuntimeError(proc.stderr[-2000:])
            got = json.loads(proc.stdout.strip().splitlines()[-1])
            got["ok"] = got["step"] == 1 and got["sums"] == ref
            del got["sums"]
            res[v].append(got)
            m = got["marks"]
            print(f"round {r} {v:8s} restore {got['restore_s'] * 1e3:6.1f} ms  manager {got['init_s'] * 1e3:6.1f}  "
                  + "  ".join(f"{k} {x * 1e3:.1f}" for k, x in m.items()) + f"  ok {got['ok']}", flush=True)
    print("\nvariant   restore ms: best / median   (the marks: median)")
    for v, recs in res.items():
        xs = [x["restore_s"] * 1e3 for x in recs]
        keys = list(recs[0]["marks"])
        med = "  ".join(f"{k} {statistics.median(x['marks'].get(k, 0) for x in recs) * 1e3:.1f}" for k in keys)
        print(f"{v:8s}  {min(xs):6.1f} / {statistics.median(xs):6.1f}   {med}   all ok: {all(x['ok'] for x in recs)}")
    if out:
        with open(out, "w") as f:
            json.dump({"state": st, "rounds": rounds, "results": res}, f, indent=1)
    import shutil

    shutil.rmtree(os.path.dirname(d), ignore_errors=True)


if __name__ == "__main__":
    main()
