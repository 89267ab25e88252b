"""Session 28 probe: a resumed job's restore (fresh process) with the bounce pool made beside the read or not.

The parent builds bench_restore's state (4.83 GB on the GPU), saves it once to /dev/shm, then runs
ROUNDS rounds of two fresh processes each, the order alternating: "prepare" (the library as it is:
``restore_apply.prepare_copies`` makes the pinned pool while the files are read) and "noprepare"
(``bulkcopy.prepare_bounce`` replaced by a no-op in the child: the pool is made at the first bounce,
as before session 28). Each child is bench_restore's ``--cold-child`` (builds the same model, zeroes
it, times one restore_latest()); the parent checks its values.

Run: python benchmarks/results/probe/s28/cold_probe.py [ROUNDS] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.join(HERE, "..", "..", "..")
sys.path.insert(0, BENCH)
import common as C  # noqa: E402
import bench_restore as B  # noqa: E402


def child(d: str, width: int, depth: int, variant: str) -> None:
    if variant == "noprepare":
        from checkpointd import bulkcopy

        bulkcopy.prepare_bounce = lambda device: None
    B.cold_child(argparse.Namespace(cold_child=d, D=width, L=depth, cpu=False))


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        d, width, depth, variant = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
        return child(d, width, depth, variant)
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 6
    out = sys.argv[sys.argv.index("--json") + 1] if "--json" in sys.argv else None
    dev = C.Dev(cpu=False)
    model, opt, st = C.build_train_state(5.0, None, None, dev, on="device")
    ref = C.sample_checksums(C.state_tensors(model, opt))
    d = "/dev/shm/ckd-coldprobe/ckpt"
    B.save_once(d, dev, model, opt, [t.clone() for t in C.state_tensors(model, opt)])
    res: dict = {"prepare": [], "noprepare": []}
    for r in range(rounds):
        for v in (["prepare", "noprepare"] if r % 2 == 0 else ["noprepare", "prepare"]):
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", d, str(st["D"]), str(st["L"]), v],
                                  capture_output=True, text=True, timeout=300)
            if proc.returncode != 0:
                raise RuntimeError(proc.stderr[-2000:])
            got = json.loads(proc.stdout.strip().splitlines()[-1])
            got["ok"] = got["step"] == 1 and got["sums"] == ref
            del got["sums"]
            res[v].append(got)
            print(f"round {r} {v:9s} restore {got['restore_s'] * 1e3:6.1f} ms  manager {got['init_s'] * 1e3:6.1f} ms  ok {got['ok']}",
                  flush=True)
    for v, recs in res.items():
        ts = [x["restore_s"] * 1e3 for x in recs]
        print(f"{v:9s} best {min(ts):6.1f}  median {statistics.median(ts):6.1f}  mean {statistics.mean(ts):6.1f}  all ok {all(x['ok'] for x in recs)}")
    diffs = [a["restore_s"] - b["restore_s"] for a, b in zip(res["prepare"], res["noprepare"])]
    print(f"paired prepare - noprepare: mean {statistics.mean(diffs) * 1e3:.1f} ms, median {statistics.median(diffs) * 1e3:.1f} ms")
    if out:
        with open(out, "w") as f:
            json.dump({"state": st, "results": res}, f, indent=1)
    import shutil

    shutil.rmtree("/dev/shm/ckd-coldprobe", ignore_errors=True)


if __name__ == "__main__":
    main()
