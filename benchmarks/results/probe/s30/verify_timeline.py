"""Session 30 probe: where a restore verified on the GPU spends its time, as a timeline.

The parent builds bench_restore's state (PROBE_GB, default 5: 4.83 GB live on the GPU), saves it once
(uncompressed) to /dev/shm and then:

- warm: ROUNDS rounds in this process, each restoring once per mode of PROBE_MODES (default
  ``device,nopop,host``: ``CHECKPOINTD_RESTORE_VERIFY=device``; the same with
  ``bulkcopy.POPULATE_AHEAD`` off; ``=host``) with a fresh manager (order rotating), 3 s after the
  previous manager's close, the live tensors zeroed first and the values checked after (s30b; from
  s30c the library's knob is ``bulkcopy.POPULATE_THREADS``, default 0, and the modes are
  ``device`` (0), ``popN`` (N threads) and ``host``);
- cold: COLD fresh processes (bench_restore's ``--cold-child``), each one restore with ``=device``.

Each restore is timed with the library's steps wrapped: read_step, read_file_verified (per file),
device_image.verify, its _allocate, bulkcopy.upload_bytes, device_crc.crc32_of, the parse
(fastload.load_native_in_place), kernel_available, apply_entries, copy_pairs, _device_to_device,
_bounced_h2d, the bounce pool's pinned_chunks, Optimizer.load_state_dict, _prepare_pending_buffers.
Printed: every wrapped step as ``start-end ms (thread)`` from the restore's start, for the last warm
round of each mode and for every cold process, and the totals.

Run: python benchmarks/results/probe/s30/verify_timeline.py [ROUNDS] [COLD] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import os
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", ".."))
import common as C  # noqa: E402
import bench_restore as B  # noqa: E402
import torch  # noqa: E402

events: list[tuple[str, str, float, float]] = []
lock = threading.Lock()
T0 = [0.0]


def timed(owner, name: str, label: str | None = None) -> None:
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            t1 = time.perf_counter()
            with lock:
                events.append((label or name, threading.current_thread().name, t0, t1))
    setattr(owner, name, wrapper)


def instrument() -> None:
    from checkpointd import bulkcopy, device_crc, device_image, fastload, restore, restore_apply
    import checkpointd.manager as M

    timed(restore, "read_step")
    timed(fastload, "read_file_verified")
    timed(fastload, "load_native_in_place", "parse")
    timed(device_image, "verify")
    timed(device_image, "_allocate")
    timed(bulkcopy, "upload_bytes")
    timed(device_crc, "crc32_of")
    timed(device_crc, "kernel_available")
    timed(restore_apply, "apply_entries")
    timed(bulkcopy, "copy_pairs")
    timed(bulkcopy, "_device_to_device")
    timed(bulkcopy, "_bounced_h2d")
    timed(bulkcopy._DevicePool, "pinned_chunks")
    timed(torch.optim.Optimizer, "load_state_dict", "optim_load")
    timed(M.CheckpointManager, "_prepare_pending_buffers", "prepare_buffers")


def timeline(t0: float, evs) -> list[str]:
    return [f"    {lab:22s} {(a - t0) * 1e3:7.1f} - {(b - t0) * 1e3:7.1f}  ({(b - a) * 1e3:6.1f})  {th}"
            for lab, th, a, b in sorted(evs, key=lambda e: e[2])]


def child(d: str, width: int, depth: int) -> None:
    instrument()
    out = io.StringIO()
    t_wall = time.perf_counter()
    with contextlib.redirect_stdout(out):
        B.cold_child(argparse.Namespace(cold_child=d, D=width, L=depth, cpu=os.environ.get("PROBE_CPU") == "1"))
    got = json.loads(out.getvalue().strip().splitlines()[-1])
    # the restore's start: read_step's wrapper is the first library step after restore_latest begins
    start = min((e[2] for e in events if e[0] in ("read_step", "kernel_available")), default=t_wall)
    got["timeline"] = timeline(start, events)
    print(json.dumps(got), flush=True)


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        return child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 4
    cold = int(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2].isdigit() else 3
    out = sys.argv[sys.argv.index("--json") + 1] if "--json" in sys.argv else None
    dev = C.Dev(cpu=os.environ.get("PROBE_CPU") == "1")  # (a CPU smoke run: PROBE_CPU=1 PROBE_GB=0.05)
    model, opt, st = C.build_train_state(float(os.environ.get("PROBE_GB", "5")), None, None, dev, on="device")
    ref = C.sample_checksums(C.state_tensors(model, opt))
    root = "/dev/shm/ckd-timeline"
    d = os.path.join(root, "ckpt")
    B.save_once(d, dev, model, opt, [t.clone() for t in C.state_tensors(model, opt)])
    instrument()
    from checkpointd import bulkcopy

    modes = os.environ.get("PROBE_MODES", "device,nopop,host").split(",")
    res: dict = {"state": st, "warm": {m: [] for m in modes}, "cold": []}
    last: dict[str, list[str]] = {}
    for r in range(rounds):
        for mode in modes[r % len(modes):] + modes[:r % len(modes)]:
            if hasattr(bulkcopy, "POPULATE_THREADS"):
                bulkcopy.POPULATE_THREADS = int(mode[3:]) if mode.startswith("pop") else 0
            else:  # s30b's library
                bulkcopy.POPULATE_AHEAD = mode != "nopop"
            time.sleep(3)
            B.zero_live(C.state_tensors(model, opt), dev)
            C.collect()
            mgr = C.make_manager(d, {"model": model, "optim": opt}, keep_last=None, compression=None)
            try:
                with C.env_set({"CHECKPOINTD_RESTORE_VERIFY": "host" if mode == "host" else "device"}):
                    with lock:
                        events.clear()
                    dev.sync()
                    t0 = time.perf_counter()
                    step = mgr.restore_latest()
                    dev.sync()
                    total = time.perf_counter() - t0
                evs = list(events)
            finally:
                mgr.close()
            ok = step == 1 and B.check(model, opt, ref)
            res["warm"][mode].append({"total_s": total, "ok": ok})
            last[mode] = timeline(t0, evs)
            print(f"round {r} {mode:6s} restore {total * 1e3:6.1f} ms ok {ok}", flush=True)
    for mode, lines in last.items():
        print(f"\nlast warm round, {mode}:")
        print("\n".join(lines))
    if hasattr(bulkcopy, "POPULATE_THREADS"):
        bulkcopy.POPULATE_THREADS = 0  # the library's default for the fresh processes
    else:
        bulkcopy.POPULATE_AHEAD = True
    del model, opt
    C.collect()
    for i in range(cold):
        time.sleep(2)
        env = dict(os.environ, CHECKPOINTD_RESTORE_VERIFY="device")
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", d, str(st["D"]), str(st["L"])],
                              capture_output=True, text=True, timeout=300, env=env)
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr[-3000:])
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        got["ok"] = got["step"] == 1 and got["sums"] == ref
        del got["sums"]
        res["cold"].append(got)
        print(f"\ncold {i}: restore {got['restore_s'] * 1e3:.1f} ms, manager {got['init_s'] * 1e3:.1f} ms, ok {got['ok']}")
        print("\n".join(got["timeline"]))
    print("\nwarm ms (best / median):")
    for mode, recs in res["warm"].items():
        xs = [x["total_s"] * 1e3 for x in recs]
        print(f"  {mode:6s} {min(xs):7.1f} {statistics.median(xs):7.1f}  all ok {all(x['ok'] for x in recs)}")
    if res["cold"]:
        xs = [x["restore_s"] * 1e3 for x in res["cold"]]
        print(f"  cold device {' '.join(f'{x:.1f}' for x in xs)}  all ok {all(x['ok'] for x in res['cold'])}")
    if out:
        with open(out, "w") as f:
            json.dump(res, f, indent=1)
    import shutil

    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
