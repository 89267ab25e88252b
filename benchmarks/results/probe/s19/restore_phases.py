"""s19 probe: where a restore_latest() of the 4.83 GB state spends its time, with and without the device mirror.

Saves one uncompressed checkpoint to /dev/shm, then restores it with CHECKPOINTD_RESTORE_MIRROR=auto and =0,
alternating, printing for each restore a timeline of the wrapped phases (ms from the call's start, per thread).
"""
import functools, json, os, sys, threading, time
sys.path.insert(0, "benchmarks")
import torch
import common as C
from checkpointd import CheckpointManager, bulkcopy, fastload, restore, restore_apply, restore_mirror

out_path = sys.argv[1] if len(sys.argv) > 1 else None
chunks = (sys.argv[2] if len(sys.argv) > 2 else "16").split(",")
dev = C.Dev(cpu=False)
model, opt, st = C.build_train_state(5.0, None, None, dev, on="device")
root = "/dev/shm/ckd-phases"
C.clean_dir(root)
with CheckpointManager(root, {"model": model, "optim": opt}, compression=None) as mgr:
    mgr.save(1)
    mgr.wait()
print("files", {f: os.path.getsize(os.path.join(root, "step-000000001", f)) for f in os.listdir(os.path.join(root, "step-000000001"))}, flush=True)
events = []
T0 = [0.0]


def wrap(owner, name, label):
    real = getattr(owner, name)

    @functools.wraps(real)
    def timed(*a, **k):
        s = time.perf_counter()
        try:
            return real(*a, **k)
        finally:
            e = time.perf_counter()
            events.append((label, threading.current_thread().name[-12:], round((s - T0[0]) * 1e3, 1), round((e - T0[0]) * 1e3, 1)))
    setattr(owner, name, timed)


wrap(restore_mirror, "for_entries", "for_entries")
wrap(restore_mirror.MirrorSet, "fill", "fill")
wrap(restore_mirror._Ring, "__init__", "ring_init")
wrap(restore_mirror._Ring, "drain", "drain")
wrap(restore_mirror._Ring, "__exit__", "ring_exit")
wrap(restore_mirror.MirrorSet, "release", "release")
wrap(fastload, "_map_file", "map_file")
wrap(fastload, "read_file_verified", "read_file_verified")
wrap(fastload, "load_native_in_place", "parse")
wrap(restore, "read_step", "read_step")
wrap(restore, "check_compatible", "check_compatible")
wrap(restore_apply, "_plan", "plan")
wrap(bulkcopy, "copy_pairs", "copy_pairs")
wrap(torch.cuda, "empty_cache", "empty_cache")
res = {"runs": []}
for trial in range(4):
    for mode in ["auto", "0"] + (["auto@" + c for c in chunks if c != "16"]):
        m, _, chunk = mode.partition("@")
        os.environ[restore_mirror.MIRROR_ENV] = m
        os.environ[restore_mirror.CHUNK_ENV] = chunk or "16"
        with torch.no_grad():
            for t in C.state_tensors(model, opt):
                t.zero_()
        torch.cuda.synchronize()
        mgr = CheckpointManager(root, {"model": model, "optim": opt}, compression=None)
        events.clear()
        T0[0] = time.perf_counter()
        step = mgr.restore_latest()
        torch.cuda.synchronize()
        total = (time.perf_counter() - T0[0]) * 1e3
        last = mgr.stats().get("last_restore")
        mgr.close()
        run = {"trial": trial, "mode": mode, "total_ms": round(total, 1), "last_restore": last, "events": list(events)}
        res["runs"].append(run)
        print(f"--- trial {trial} mode {mode}: {total:.1f} ms, mirrored {last and last.get('mirrored_bytes')}", flush=True)
        for ev in sorted(events, key=lambda e: e[2]):
            print("   ", ev, flush=True)
if out_path:
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)
C.clean_dir(root)
