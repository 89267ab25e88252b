"""s20 probe (s19's restore_phases2.py plus the checksum pass as its own event): where restore_latest() of the 4.83 GB state spends its time (today's code), finer than s19e.

Saves one uncompressed checkpoint to /dev/shm, then restores it six times into the zeroed live state, a
second apart (gc first, so the previous restore's buffers are gone), printing each restore's timeline of
wrapped calls (ms from the call's start; per thread).
"""
import functools, gc, json, os, sys, threading, time
sys.path.insert(0, "benchmarks")
import torch
import common as C
from checkpointd import CheckpointManager, bulkcopy, commit, fastload, manager, ptlayout, restore, restore_apply, snapshot
print('checkpointd from', fastload.__file__, flush=True)

out_path = sys.argv[1] if len(sys.argv) > 1 else None
dev = C.Dev(cpu=False)
model, opt, st = C.build_train_state(5.0, None, None, dev, on="device")
root = "/dev/shm/ckd-phases"
C.clean_dir(root)
with CheckpointManager(root, {"model": model, "optim": opt}, compression=None) as mgr:
    mgr.save(1)
    mgr.wait()
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


wrap(manager.CheckpointManager, "wait", "mgr.wait")
wrap(manager.CheckpointManager, "steps", "mgr.steps")
wrap(manager.CheckpointManager, "_prepare_pending_buffers", "prepare_pending_buffers")
wrap(manager, "build_files", "build_files")
wrap(manager, "capture_rng", "capture_rng")
wrap(manager, "staging_layout", "staging_layout")
wrap(manager, "restore_rng", "restore_rng")
wrap(snapshot.Snapshotter, "prepare_async", "prepare_async")
wrap(restore, "restore_in_place", "restore_in_place")
wrap(commit, "read_committed_manifest", "read_manifest")
wrap(restore, "read_step", "read_step")
wrap(fastload, "read_file_verified", "read_file_verified")
wrap(fastload, "load_native_in_place", "parse")
wrap(ptlayout, "run_tasks", "crc_pass")
wrap(restore, "check_file", "check_file")
wrap(restore, "values_by_entry", "values_by_entry")
wrap(restore, "check_compatible", "check_compatible")
wrap(restore_apply, "apply_entries", "apply_entries")
wrap(bulkcopy, "copy_pairs", "copy_pairs")
wrap(torch.optim.Optimizer, "load_state_dict", "opt.load_state_dict")
wrap(restore, "match_optimizer_state_layout", "match_layout")
wrap(restore, "rng_of", "rng_of")
wrap(restore, "drop_later", "drop_later")
res = {"runs": []}
for trial in range(6):
    with torch.no_grad():
        for t in C.state_tensors(model, opt):
            t.zero_()
    torch.cuda.synchronize()
    gc.collect()
    time.sleep(1.0)
    if os.environ.get("PHASES_FRESH_POOL") == "1":
        bulkcopy.release_pinned()  # every trial a resumed process's first restore: nothing pinned yet
    ti = time.perf_counter()
    mgr = CheckpointManager(root, {"model": model, "optim": opt}, compression=None)
    init_ms = (time.perf_counter() - ti) * 1e3
    events.clear()
    T0[0] = time.perf_counter()
    step = mgr.restore_latest()
    torch.cuda.synchronize()
    total = (time.perf_counter() - T0[0]) * 1e3
    mgr.close()
    run = {"trial": trial, "total_ms": round(total, 1), "init_ms": round(init_ms, 1), "events": list(events)}
    res["runs"].append(run)
    print(f"--- trial {trial}: {total:.1f} ms (manager init {init_ms:.1f} ms)", flush=True)
    for ev in sorted(events, key=lambda e: e[2]):
        print("   ", ev, flush=True)
if out_path:
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)
C.clean_dir(root)
