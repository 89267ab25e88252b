"""s20 probe: a resumed job's restore, in a fresh process (the only restore a real resume does).

`save`: build the 4.83 GB state on the GPU and save it to /dev/shm/ckd-cold. `restore`: a fresh process
builds the same model (values zeroed), constructs a manager, restores (timed, with read_step and
copy_pairs timed inside), then zeroes and restores again with a new manager (the warm case the
benchmarks' best-of-N reports). Prints one JSON line.
"""
import functools, gc, json, sys, time
sys.path.insert(0, "benchmarks")
import torch
import common as C
from checkpointd import CheckpointManager, bulkcopy, restore

root = "/dev/shm/ckd-cold"
dev = C.Dev(cpu=False)
t_build = time.perf_counter()
model, opt, st = C.build_train_state(5.0, None, None, dev, on="device")
t_build = time.perf_counter() - t_build
if sys.argv[1] == "save":
    C.clean_dir(root)
    with CheckpointManager(root, {"model": model, "optim": opt}, compression=None) as mgr:
        mgr.save(1)
        mgr.wait()
    print(json.dumps({"saved": st["state_bytes"], "build_s": round(t_build, 1)}))
    sys.exit(0)
events = {}
def wrap(owner, name):
    real = getattr(owner, name)
    @functools.wraps(real)
    def timed(*a, **k):
        s = time.perf_counter()
        try:
            return real(*a, **k)
        finally:
            events.setdefault(name, []).append(round((time.perf_counter() - s) * 1e3, 1))
    setattr(owner, name, timed)
wrap(restore, "read_step")
wrap(bulkcopy, "copy_pairs")
wrap(bulkcopy._DevicePool, "pinned_chunks")
out = {"build_s": round(t_build, 1)}
for k in ("cold", "warm"):
    with torch.no_grad():
        for t in C.state_tensors(model, opt):
            t.zero_()
    torch.cuda.synchronize()
    gc.collect()
    time.sleep(0.5)
    events.clear()
    t0 = time.perf_counter()
    mgr = CheckpointManager(root, {"model": model, "optim": opt}, compression=None)
    t1 = time.perf_counter()
    step = mgr.restore_latest()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    mgr.close()
    out[k] = {"init_ms": round((t1 - t0) * 1e3, 1), "restore_ms": round((t2 - t1) * 1e3, 1), "step": step,
              "read_step_ms": events.get("read_step"), "copy_pairs_ms": events.get("copy_pairs"),
              "pinned_chunks_ms": events.get("pinned_chunks")}
print(json.dumps(out), flush=True)
