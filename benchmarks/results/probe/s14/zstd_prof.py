"""Where a zstd save's file threads spend their time (s14): wait for compressed chunks vs write them."""
import os, sys, time, threading, shutil, collections
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import torch, common as C
from checkpointd import compress as Z, writer as W
acc = collections.defaultdict(lambda: collections.defaultdict(float))
def _drain_one(self):
    future, n = self._inflight.popleft()
    t0 = time.perf_counter(); r = future.result(); t1 = time.perf_counter()
    self._emit(r, n); t2 = time.perf_counter()
    a = acc[threading.current_thread().name]; a["wait"] += t1 - t0; a["emit"] += t2 - t1; a["chunks"] += 1
Z._ChunkedEncoder._drain_one = _drain_one
orig_submit = Z._ChunkedEncoder._submit
def _submit(self, piece, dtype):
    t0 = time.perf_counter(); orig_submit(self, piece, dtype)
    acc[threading.current_thread().name]["submit(incl drains)"] += time.perf_counter() - t0
Z._ChunkedEncoder._submit = _submit
orig_wof = W.write_one_file
def write_one_file(*a, **k):
    t0 = time.perf_counter()
    try: return orig_wof(*a, **k)
    finally: acc[threading.current_thread().name]["write_one_file"] += time.perf_counter() - t0
W.write_one_file = write_one_file
gb = float(sys.argv[1]) if len(sys.argv) > 1 else 5.0
dev = C.Dev(cpu=not torch.cuda.is_available())
model, opt, st = C.build_train_state(gb, None, None, dev, on="cpu")
root = "/dev/shm/ckd-zprof"
for rep in range(3):
    shutil.rmtree(root, ignore_errors=True); acc.clear()
    with C.make_manager(root, {"model": model, "optim": opt}, keep_last=None, compression="zstd") as mgr:
        t0 = time.perf_counter(); mgr.maybe_save(1, force=True); t1 = time.perf_counter(); mgr.wait(); t2 = time.perf_counter()
        last = mgr.stats().get("last_save", {})
    print(f"rep {rep}: call {t1-t0:.3f} s, wait {t2-t1:.3f} s, write_secs {last.get('write_secs')}, pool {Z.default_executor()._max_workers}")
    for name, a in sorted(acc.items()):
        print("   ", name, {k: round(v, 3) for k, v in a.items()})
shutil.rmtree(root, ignore_errors=True)
