import os, sys, time, torch, shutil
sys.path.insert(0, "src")
import checkpointd
from checkpointd import recycle
d = "/dev/shm/ckd-trace"; shutil.rmtree(d, ignore_errors=True)
m = torch.nn.Linear(4096, 4096 * 8)  # 0.5 GB
opt = torch.optim.AdamW(m.parameters()); m(torch.randn(1, 4096)).sum().backward(); opt.step()
mgr = checkpointd.CheckpointManager(d, {"model": m, "optim": opt}, keep_last=1, max_pending=1, compression=None)
def binls():
    b = os.path.join(d, recycle.BIN_NAME)
    return sorted((f.split("-")[0][:10] + f[-9:], os.path.getsize(os.path.join(b, f)) >> 20) for f in os.listdir(b)) if os.path.isdir(b) else []
for step in range(1, 7):
    sd = [x for x in os.listdir(d) if x.startswith("step")] if os.path.isdir(d) else []
    print("before", step, binls(), [(x, [(f, os.path.getsize(os.path.join(d, x, f)) >> 20) for f in os.listdir(os.path.join(d, x))]) for x in sd])
    t0 = time.perf_counter(); mgr.maybe_save(step, force=True); mgr.wait(); t = time.perf_counter() - t0
    ls = mgr.stats()["last_save"]
    print(f"save {step}: {t:.3f} s write {ls['write_secs']:.3f} retention {ls['retention_secs']:.3f} recycled {ls['files_recycled']}/{ls['files']}")
    if step == 2: time.sleep(0)
mgr.close()
