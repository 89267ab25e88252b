"""s21i probe: where a host-budget (25 %) save's time goes: producer waits for free chunks, copy
enqueues, consumers' waits for arrived chunks, pwrite and CRC time (summed over threads), and when the
last chunk was issued (what the optimizer step waits for). 4.83 GB reference state, tmpfs."""
import json, os, sys, threading, time, shutil
import torch
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import common as C
from checkpointd import CheckpointManager, chunkstream, crc as crcmod

acc = {}
lock = threading.Lock()
def add(k, dt, n=1):
    with lock:
        a = acc.setdefault(k, [0.0, 0]); a[0] += dt; a[1] += n
def wrap(obj, name, key):
    f = getattr(obj, name)
    def g(*a, **k):
        t = time.perf_counter()
        try: return f(*a, **k)
        finally: add(key, time.perf_counter() - t)
    setattr(obj, name, g)
wrap(chunkstream.ChunkRing, "acquire", "producer: acquire (wait for a free chunk)")
wrap(chunkstream.CudaCopier, "copy", "producer: copy enqueue")
wrap(chunkstream.CudaCopier, "wait_host", "consumer: wait for a chunk's copy")
wrap(chunkstream.ChunkStream, "_await", "consumer: _await total")
wrap(crcmod, "crc32", "crc32")
_pw = os.pwrite
def pw(fd, data, off):
    t = time.perf_counter(); n = _pw(fd, data, off); add("pwrite", time.perf_counter() - t); add("pwrite bytes", 0.0, n); return n
os.pwrite = pw
marks = {}
_produce = chunkstream.ChunkStream.produce
def produce(self):
    marks["produce_start"] = time.perf_counter()
    try: return _produce(self)
    finally: marks["produce_end"] = time.perf_counter()
chunkstream.ChunkStream.produce = produce

dev = C.Dev()
model, opt, st = C.build_train_state(5.0, None, None, dev)
budget = int(0.25 * st["state_bytes"])
root = "/dev/shm/ckd-h25probe"; shutil.rmtree(root, ignore_errors=True)
mgr = CheckpointManager(root, {"model": model, "optim": opt}, keep_last=1, host_staging_budget_bytes=budget, compression=None)
D = st["D"]
out = []
for step in range(1, 6):
    x = torch.randn(2, 64, D, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(x).float().square().mean()
    loss.backward()
    torch.cuda.synchronize()
    acc.clear(); marks.clear()
    t0 = time.perf_counter()
    mgr.maybe_save(step, force=True)
    t1 = time.perf_counter()
    opt.step()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    mgr.wait()
    t3 = time.perf_counter()
    row = {"step": step, "save_call_ms": (t1 - t0) * 1e3, "optimizer_step_done_ms": (t2 - t0) * 1e3, "persist_done_ms": (t3 - t0) * 1e3,
           "produce_start_ms": (marks.get("produce_start", t0) - t0) * 1e3, "produce_end_ms": (marks.get("produce_end", t0) - t0) * 1e3,
           "sums_ms": {k: round(v[0] * 1e3, 1) for k, v in acc.items() if k != "pwrite bytes"},
           "calls": {k: v[1] for k, v in acc.items()}}
    out.append(row)
    print(json.dumps(row), flush=True)
mgr.close()
print("budget", budget, "state", st["state_bytes"], "io_threads", __import__("checkpointd.ptlayout", fromlist=["x"]).io_threads())
if os.environ.get("OUT"):
    json.dump(out, open(os.path.join(os.environ["OUT"], "host25-probe-s21i.json"), "w"), indent=1)
