"""Session 31 probe: the restore verified on the GPU, old and new behaviour alternated in one process.

Derived from session 30's ``verify_timeline.py``. The parent builds bench_restore's state (PROBE_GB,
default 5: 4.83 GB live on the GPU), saves it once (uncompressed) to /dev/shm and then:

- warm: ROUNDS rounds, each restoring once per mode of PROBE_MODES (default ``old,idle,new,host``) with a
  fresh manager (order rotating), 3 s after the previous manager's close, the live tensors zeroed first
  and the values checked after. Modes: ``old`` = session 30's behaviour (the parse after the device
  checksum: ``bulkcopy._locked`` ignores the work given for the wait; the switch interval left alone),
  ``idle`` = the parse while the upload waits for the pinned chunks, ``new`` = that and the short switch
  interval (the library's defaults now), ``host`` = ``CHECKPOINTD_RESTORE_VERIFY=host``;
- profile: PROFILE restores in ``new`` mode under cProfile (main thread: the apply, the buffers'
  preparation), the library's functions printed by cumulative and own time;
- cold: COLD fresh processes per mode of PROBE_COLD_MODES (default ``old,new``, alternated; bench_restore's
  ``--cold-child``), one restore each: ``old`` = session 30's behaviour (as above, plus a CRC table per
  file size, and in s31b's library no ``restore_ahead``), ``new`` = the defaults.

Each restore is timed with the library's steps wrapped (as session 30's probe) and printed as a timeline
for the last warm round of each mode and every cold process.

Run: python benchmarks/results/probe/s31/restore_ab.py [ROUNDS] [COLD] [--json out.json]
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
    timed(bulkcopy, "device_to_device" if hasattr(bulkcopy, "device_to_device") else "_device_to_device", "device_to_device")
    timed(bulkcopy, "_bounced_h2d")
    timed(bulkcopy._DevicePool, "pinned_chunks")
    timed(torch.optim.Optimizer, "load_state_dict", "optim_load")
    timed(M.CheckpointManager, "_prepare_pending_buffers", "prepare_buffers")
    try:  # s31b's library only (restore_ahead was measured there and removed)
        from checkpointd import restore_ahead
    except ImportError:
        return
    timed(restore_ahead, "_warm", "ahead_warm")
    timed(bulkcopy, "pin_ahead")


def timeline(t0: float, evs) -> list[str]:
    return [f"    {lab:22s} {(a - t0) * 1e3:7.1f} - {(b - t0) * 1e3:7.1f}  ({(b - a) * 1e3:6.1f})  {th}"
            for lab, th, a, b in sorted(evs, key=lambda e: e[2])]


def child(d: str, width: int, depth: int) -> None:
    instrument()
    if os.environ.get("PROBE_COLD_MODE") == "old":  # session 30's behaviour in a fresh process
        from checkpointd import bulkcopy, device_crc, device_image

        if hasattr(bulkcopy, "_locked"):  # s31a-s31c's library (the parse in the wait, measured and removed)
            real_locked = bulkcopy._locked
            bulkcopy._locked = lambda lock, while_waiting: real_locked(lock, None)
        device_image.SWITCH_INTERVAL_SECS = 0.0
        device_crc.ROUNDS_BUILT = 0  # a table per file size
        try:  # s31b's library only
            from checkpointd import restore_ahead

            restore_ahead.start = lambda *a: None
        except ImportError:
            pass
    out = io.StringIO()
    t_wall = time.perf_counter()
    with contextlib.redirect_stdout(out):
        B.cold_child(argparse.Namespace(cold_child=d, D=width, L=depth, cpu=os.environ.get("PROBE_CPU") == "1"))
    got = json.loads(out.getvalue().strip().splitlines()[-1])
    # the restore's start: read_step's wrapper is the first library step after restore_latest begins
    start = min((e[2] for e in events if e[0] in ("read_step", "kernel_available")), default=t_wall)
    got["timeline"] = timeline(start, events)
    print(json.dumps(got), flush=True)


def profile(n: int, d: str, dev, model, opt) -> None:
    """``n`` warm restores (the defaults) under cProfile on the main thread; the library's share printed."""
    import cProfile
    import pstats

    for i in range(n):
        time.sleep(3)
        B.zero_live(C.state_tensors(model, opt), dev)
        C.collect()
        mgr = C.make_manager(d, {"model": model, "optim": opt}, keep_last=None, compression=None)
        prof = cProfile.Profile()
        try:
            dev.sync()
            t0 = time.perf_counter()
            prof.enable()
            mgr.restore_latest()
            dev.sync()
            prof.disable()
            total = time.perf_counter() - t0
        finally:
            mgr.close()
        print(f"\nprofile {i}: restore {total * 1e3:.1f} ms (under cProfile)")
        for key in ("cumulative", "tottime"):
            text = io.StringIO()
            st = pstats.Stats(prof, stream=text)
            st.sort_stats(key).print_stats(45)
            print(f"-- by {key}")
            print("\n".join(line[:170] for line in text.getvalue().splitlines()[6:] if line.strip()))


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

    modes = os.environ.get("PROBE_MODES", "old,idle,new,host").split(",")
    from checkpointd import device_image

    real_locked = getattr(bulkcopy, "_locked", None)  # None: the final library (s31e), without the wait's parse
    real_switch = getattr(device_image, "SWITCH_INTERVAL_SECS", 0.0)

    def ignoring_wait(lock, while_waiting):
        return real_locked(lock, None)

    def set_mode(mode: str) -> None:
        if real_locked is not None:
            bulkcopy._locked = ignoring_wait if mode == "old" else real_locked
            device_image.SWITCH_INTERVAL_SECS = real_switch if mode == "new" else 0.0

    res: dict = {"state": st, "warm": {m: [] for m in modes}, "cold": []}
    last: dict[str, list[str]] = {}
    for r in range(rounds):
        for mode in modes[r % len(modes):] + modes[:r % len(modes)]:
            set_mode(mode)
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
    set_mode("new")
    profile(int(os.environ.get("PROFILE", "2")), d, dev, model, opt)
    del model, opt
    C.collect()
    cold_modes = os.environ.get("PROBE_COLD_MODES", "old,new").split(",")
    for i in range(cold * len(cold_modes)):
        cmode = cold_modes[i % len(cold_modes)]
        time.sleep(2)
        env = dict(os.environ, CHECKPOINTD_RESTORE_VERIFY="device", PROBE_COLD_MODE=cmode)
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", d, str(st["D"]), str(st["L"])],
                              capture_output=True, text=True, timeout=300, env=env)
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr[-3000:])
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        got["ok"] = got["step"] == 1 and got["sums"] == ref
        got["mode"] = cmode
        del got["sums"]
        res["cold"].append(got)
        print(f"\ncold {i} ({cmode}): restore {got['restore_s'] * 1e3:.1f} ms, manager {got['init_s'] * 1e3:.1f} ms, ok {got['ok']}")
        print("\n".join(got["timeline"]))
    print("\nwarm ms (best / median):")
    for mode, recs in res["warm"].items():
        xs = [x["total_s"] * 1e3 for x in recs]
        print(f"  {mode:6s} {min(xs):7.1f} {statistics.median(xs):7.1f}  all ok {all(x['ok'] for x in recs)}")
    for cmode in cold_modes:
        recs = [x for x in res["cold"] if x["mode"] == cmode]
        xs = [x["restore_s"] * 1e3 for x in recs]
        if xs:
            print(f"  cold {cmode:4s} {' '.join(f'{x:.1f}' for x in xs)}  median {statistics.median(xs):.1f}  all ok {all(x['ok'] for x in recs)}")
    if out:
        with open(out, "w") as f:
            json.dump(res, f, indent=1)
    import shutil

    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
