"""CPU seconds each Python thread of the training process spends per sharded save (torchrun, 2 ranks).

    torchrun --nproc_per_node=2 .probe/thread_cpu.py [--cpu] [--D 2048] [--L 8] [--saves 6] [--every 20]
"""
import argparse, os, sys, time, threading, json, collections
import torch, torch.distributed as dist
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import common as C
from torch.distributed.fsdp import fully_shard
from checkpointd import CheckpointManager
import cProfile, pstats, io
from checkpointd import writer as _W
PROFS = []
CALLPROF = []
_orig = _W.BackgroundWriter._handle
def _handle(self, job):
    pr = cProfile.Profile(); pr.enable()
    try:
        return _orig(self, job)
    finally:
        pr.disable(); PROFS.append(pr)
# (thread profiling off: Python 3.12 allows one profiler)
FILEPROF = cProfile.Profile()
_FLOCK = threading.Lock()
_orig_wp = _W._write_parallel
def _write_parallel(*a, **k):
    # one file thread at a time is profiled (cProfile is per thread): the others run plain
    if _FLOCK.acquire(blocking=False):
        try:
            FILEPROF.enable()
            try:
                return _orig_wp(*a, **k)
            finally:
                FILEPROF.disable()
        finally:
            _FLOCK.release()
    return _orig_wp(*a, **k)

ap = argparse.ArgumentParser()
ap.add_argument("--cpu", action="store_true"); ap.add_argument("--D", type=int, default=2048)
ap.add_argument("--L", type=int, default=8); ap.add_argument("--saves", type=int, default=6)
ap.add_argument("--every", type=int, default=20); ap.add_argument("--dir", default="/dev/shm/ckd-thrcpu")
ap.add_argument("--B", type=int, default=8); ap.add_argument("--S", type=int, default=512)
ap.add_argument("--json", default=None)
a = ap.parse_args()
cuda = torch.cuda.is_available() and not a.cpu
rank = int(os.environ["RANK"]); local = int(os.environ.get("LOCAL_RANK", 0))
if cuda:
    torch.cuda.set_device(local)
dist.init_process_group("nccl" if cuda else "gloo")
dev = C.Dev(cpu=not cuda)
torch.manual_seed(0)
model = C.make_model(a.D, a.L, dev.device)
for b in model:
    fully_shard(b)
fully_shard(model)
opt = C.make_optimizer(model, dev)
x = torch.randn(a.B, a.S, a.D, device=dev.device)

def step():
    with torch.autocast(dev.device.type, dtype=torch.bfloat16, enabled=cuda):
        loss = model(x).float().pow(2).mean()
    loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)

def cpu_by_thread():
    out = {}
    for t in threading.enumerate():
        try:
            cid = time.pthread_getcpuclockid(t.ident)
            out[(t.name, t.ident)] = time.clock_gettime(cid)
        except Exception:
            pass
    return out

def ctx_by_thread():
    out = {}
    for t in threading.enumerate():
        try:
            with open(f"/proc/self/task/{t.native_id}/status") as f:
                v = sum(int(l.split()[1]) for l in f if l.startswith(("voluntary_ctxt", "nonvoluntary_ctxt")))
            out[(t.name, t.ident)] = v
        except Exception:
            pass
    return out

def proc_cpu():
    r = os.times(); return r.user + r.system

for _ in range(3):
    step()
dev.sync()
if rank == 0:
    import shutil; shutil.rmtree(a.dir, ignore_errors=True)
    os.makedirs(a.dir, exist_ok=True)
dist.barrier()
d = a.dir
mgr = CheckpointManager(d, {"model": model, "optim": opt}, mode="sharded", compression=None, keep_last=1, max_pending=1)
time.sleep(3 if cuda else 1)
rows = []
for s in range(1, a.saves + 1):
    for _ in range(a.every - 1):
        step()
    dev.sync()
    before, p0, w0, c0 = cpu_by_thread(), proc_cpu(), time.perf_counter(), ctx_by_thread()
    step()
    dev.sync()
    pr = cProfile.Profile() if s == a.saves else None
    t0 = time.perf_counter()
    if pr: pr.enable()
    mgr.maybe_save(s * a.every, force=True)
    if pr: pr.disable(); CALLPROF.append(pr)
    call = time.perf_counter() - t0
    steps_during = 0
    while mgr.stats().get("saves_pending", 0) and steps_during < 200:
        step(); dev.sync(); steps_during += 1
    mgr.wait()
    after, p1, w1, c1 = cpu_by_thread(), proc_cpu(), time.perf_counter(), ctx_by_thread()
    ctx = collections.Counter()
    for k, v in c1.items():
        ctx[k[0].rstrip("0123456789_")] += v - c0.get(k, 0)
    per = collections.Counter()
    for k, v in after.items():
        per[k[0].rstrip("0123456789_")] += v - before.get(k, 0.0)
    rows.append({"save": s, "call_ms": 1e3 * call, "steps_during": steps_during, "wall_ms": 1e3 * (w1 - w0),
                 "proc_cpu_ms": 1e3 * (p1 - p0), "threads_ms": {k: round(1e3 * v, 2) for k, v in per.most_common() if v > 1e-4}, "ctx_switches": dict(ctx.most_common()),
                 "stats": {k: v for k, v in mgr.stats().items() if k.startswith("last.")}})
mgr.close()
if rank == 0:
    for r in rows:
        print(json.dumps(r), flush=True)
    out = open(a.json + ".prof.txt", "w") if a.json else sys.stdout
    if CALLPROF:
        st = io.StringIO(); ps = pstats.Stats(CALLPROF[-1], stream=st); ps.sort_stats("cumtime").print_stats(35); print(st.getvalue()[:7000], file=out)
    if PROFS:
        st = io.StringIO(); ps = pstats.Stats(PROFS[-1], stream=st); ps.sort_stats("tottime").print_stats(25); print(st.getvalue()[:6000], file=out)
        st = io.StringIO(); ps = pstats.Stats(PROFS[-1], stream=st); ps.sort_stats("cumtime").print_stats(40); print(st.getvalue()[:8000], file=out)
    if a.json:
        json.dump(rows, open(a.json, "w"), indent=1)
dist.barrier()
dist.destroy_process_group()
os._exit(0)
