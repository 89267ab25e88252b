"""Session 28 probe: restore_latest with and without the device image, interleaved, timed inside.

One 4.83 GB checkpoint (bench_restore's state) in /dev/shm; ROUNDS rounds, each restoring it once per
variant (the order rotated each round), each restore by a fresh manager (as bench_restore's rows do), the live
tensors zeroed and CUDA's cache emptied first. Inside each restore: read_step (verified read, with the
upload when the image is on), the apply, and the uploads themselves. Values checked after each.

Needs ``restore_image.patch`` (beside this file) applied: the device image was not kept in the library.

Run: python benchmarks/results/probe/s28/image_probe.py [ROUNDS] [--json out.json]
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

from checkpointd import device_image, restore  # noqa: E402

VARIANTS = {"noimage": {"CHECKPOINTD_RESTORE_IMAGE": "0"},
            "image": {"CHECKPOINTD_RESTORE_IMAGE": "auto", "CHECKPOINTD_RESTORE_UPLOAD": "thread"},
            "pieces4": {"CHECKPOINTD_RESTORE_IMAGE": "auto", "CHECKPOINTD_RESTORE_UPLOAD": "pieces", "CHECKPOINTD_RESTORE_PIECE_MB": "4"},
            "pieces8": {"CHECKPOINTD_RESTORE_IMAGE": "auto", "CHECKPOINTD_RESTORE_UPLOAD": "pieces", "CHECKPOINTD_RESTORE_PIECE_MB": "8"},
            "pieces2": {"CHECKPOINTD_RESTORE_IMAGE": "auto", "CHECKPOINTD_RESTORE_UPLOAD": "pieces", "CHECKPOINTD_RESTORE_PIECE_MB": "2"}}


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 8
    out = sys.argv[sys.argv.index("--json") + 1] if "--json" in sys.argv else None
    dev = C.Dev(cpu=os.environ.get("PROBE_CPU") == "1")  # (a CPU smoke run: PROBE_CPU=1 PROBE_GB=0.05)
    model, opt, st = C.build_train_state(float(os.environ.get("PROBE_GB", "5")), None, None, dev, on="device")
    live = C.state_tensors(model, opt)
    ref = C.sample_checksums(live)
    root = "/dev/shm/ckd-imageprobe"
    d = os.path.join(root, "ckpt")
    B.save_once(d, dev, model, opt, [t.clone() for t in live])
    marks: list[tuple[str, float]] = []

    def timed(name, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                marks.append((name, time.perf_counter() - t0))
        return wrapper

    restore.read_step = timed("read_step", restore.read_step)
    restore._apply = timed("apply", restore._apply)
    device_image.upload = timed("upload", device_image.upload)
    res: dict = {v: [] for v in VARIANTS}
    for r in range(rounds):
        order = list(VARIANTS)[r % len(VARIANTS):] + list(VARIANTS)[:r % len(VARIANTS)]  # each first in turn
        for v in order:
            B.zero_live(C.state_tensors(model, opt), dev)
            C.collect()
            marks.clear()
            mgr = C.make_manager(d, {"model": model, "optim": opt}, keep_last=None, compression=None)
            try:
                with C.env_set(VARIANTS[v]):
                    before = dict(device_image.stats)
                    dev.sync()
                    t0 = time.perf_counter()
                    step = mgr.restore_latest()
                    dev.sync()
                    total = time.perf_counter() - t0
            finally:
                mgr.close()
            ok = step == 1 and B.check(model, opt, ref)
            rec = {"total": total, "ok": ok, "uploads": device_image.stats["uploads"] - before["uploads"],
                   "copies": device_image.stats["copies"] - before["copies"]}
            for name, secs in marks:
                rec.setdefault(name, []).append(secs)
            res[v].append(rec)
            print(f"round {r} {v:8s} total {total * 1e3:6.1f} ms  read_step {sum(rec.get('read_step', [0])) * 1e3:6.1f}"
                  f"  apply {sum(rec.get('apply', [0])) * 1e3:6.1f}  uploads {[round(x * 1e3, 1) for x in rec.get('upload', [])]}"
                  f"  n_up {rec['uploads']} copies {rec['copies']} ok {ok}", flush=True)
    print("\nvariant   best   median  mean   (ms, restore_latest, fresh manager each)")
    for v, recs in res.items():
        ts = [x["total"] * 1e3 for x in recs]
        print(f"{v:8s} {min(ts):6.1f} {statistics.median(ts):6.1f} {statistics.mean(ts):6.1f}  all ok: {all(x['ok'] for x in recs)}")
    for v in list(VARIANTS)[1:]:
        diffs = [a["total"] - b["total"] for a, b in zip(res[v], res["noimage"])]
        print(f"paired {v} - noimage: mean {statistics.mean(diffs) * 1e3:.1f} ms, median {statistics.median(diffs) * 1e3:.1f} ms")
    if out:
        with open(out, "w") as f:
            json.dump({"state": st, "rounds": rounds, "results": res}, f, indent=1)
    import shutil

    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
