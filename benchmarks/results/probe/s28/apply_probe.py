"""Session 28 probe: where a restore's apply spends its time, with small pairs packed or not.

One 4.83 GB checkpoint (bench_restore's state) in /dev/shm; ROUNDS rounds, each restoring it once per
variant (the order alternating), each by a fresh manager (as bench_restore's rows do), the live tensors
zeroed and CUDA's cache emptied first. Variants: ``bulkcopy.PACK_BELOW_BYTES`` at 1 MiB ("pack", pairs
below it share pinned chunks) and 0 ("nopack", a chunk per pair as before session 28). Inside each
restore: read_step (the verified read), apply_entries, and its copy_pairs (the bounce); the rest of
the apply is planning and torch's optimizer load. Values checked after each.

Run: python benchmarks/results/probe/s28/apply_probe.py [ROUNDS] [--json out.json]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", ".."))
import common as C  # noqa: E402
import bench_restore as B  # noqa: E402

from checkpointd import bulkcopy, restore, restore_apply  # noqa: E402

VARIANTS = {"pack": 1 << 20, "nopack": 0}


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 8
    out = sys.argv[sys.argv.index("--json") + 1] if "--json" in sys.argv else None
    dev = C.Dev(cpu=os.environ.get("PROBE_CPU") == "1")  # (a CPU smoke run: PROBE_CPU=1 PROBE_GB=0.05)
    model, opt, st = C.build_train_state(float(os.environ.get("PROBE_GB", "5")), None, None, dev, on="device")
    ref = C.sample_checksums(C.state_tensors(model, opt))
    root = "/dev/shm/ckd-applyprobe"
    d = os.path.join(root, "ckpt")
    B.save_once(d, dev, model, opt, [t.clone() for t in C.state_tensors(model, opt)])
    marks: list[tuple[str, float]] = []
    counts: dict[str, int] = {}

    def timed(name, fn):
        def wrapper(*a, **k):
            if name == "copy_pairs":
                counts["pairs"] = len(a[0])
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                marks.append((name, time.perf_counter() - t0))
        return wrapper

    restore.read_step = timed("read_step", restore.read_step)
    restore_apply.apply_entries = timed("apply", restore_apply.apply_entries)
    bulkcopy.copy_pairs = timed("copy_pairs", bulkcopy.copy_pairs)
    res: dict = {v: [] for v in VARIANTS}
    for r in range(rounds):
        order = list(VARIANTS) if r % 2 == 0 else list(VARIANTS)[::-1]
        for v in order:
            bulkcopy.PACK_BELOW_BYTES = VARIANTS[v]
            B.zero_live(C.state_tensors(model, opt), dev)
            C.collect()
            marks.clear()
            mgr = C.make_manager(d, {"model": model, "optim": opt}, keep_last=None, compression=None)
            try:
                dev.sync()
                t0 = time.perf_counter()
                step = mgr.restore_latest()
                dev.sync()
                total = time.perf_counter() - t0
            finally:
                mgr.close()
            rec = {"total": total, "ok": step == 1 and B.check(model, opt, ref), "pairs": counts.get("pairs")}
            for name, secs in marks:
                rec[name] = rec.get(name, 0.0) + secs
            res[v].append(rec)
            print(f"round {r} {v:7s} total {total * 1e3:6.1f} ms  read_step {rec.get('read_step', 0) * 1e3:6.1f}"
                  f"  apply {rec.get('apply', 0) * 1e3:6.1f}  copy_pairs {rec.get('copy_pairs', 0) * 1e3:6.1f}"
                  f"  ({rec['pairs']} pairs)  ok {rec['ok']}", flush=True)
    print("\nvariant  (ms: best / median)  total          read_step      apply          copy_pairs     apply - copy_pairs")
    for v, recs in res.items():
        cols = []
        for key in ("total", "read_step", "apply", "copy_pairs"):
            xs = [x.get(key, 0) * 1e3 for x in recs]
            cols.append(f"{min(xs):6.1f} / {statistics.median(xs):6.1f}")
        rest = [(x.get("apply", 0) - x.get("copy_pairs", 0)) * 1e3 for x in recs]
        cols.append(f"{min(rest):6.1f} / {statistics.median(rest):6.1f}")
        print(f"{v:7s}                   " + "  ".join(cols) + f"   all ok: {all(x['ok'] for x in recs)}")
    diffs = [a["total"] - b["total"] for a, b in zip(res["pack"], res["nopack"])]
    print(f"paired pack - nopack (total): mean {statistics.mean(diffs) * 1e3:.1f} ms, median {statistics.median(diffs) * 1e3:.1f} ms")
    if out:
        with open(out, "w") as f:
            json.dump({"state": st, "rounds": rounds, "results": res}, f, indent=1)
    import shutil

    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
