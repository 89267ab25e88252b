"""Session 36 probe (2-core dev VM, CPU): a zstd restore's phases. Saves a ~0.9 GB state (D=1024, L=6,
poorly compressible random values) with compression="zstd", then restores it three times, printing each
file's verified read, decode and in-place load (start ms from the restore's start, duration ms), and
finally decodes each file alone and compares allocating fresh output pages with refilling touched ones.
Run from the repository root with PYTHONPATH=src: python benchmarks/results/probe/s36/zstd_restore_cpu.py"""
import functools, glob, os, sys, tempfile, time
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../.."))
import torch
import common as C
from checkpointd import CheckpointManager, bulkcopy, fastload

log = []


def timed(mod, name):
    f = getattr(mod, name)

    @functools.wraps(f)
    def g(*a, **k):
        t0 = time.perf_counter()
        r = f(*a, **k)
        log.append((name, t0, time.perf_counter() - t0))
        return r
    setattr(mod, name, g)


for n in ("read_file_verified", "decode_to_buffer", "load_native_in_place"):
    timed(fastload, n)
timed(bulkcopy, "copy_pairs")
torch.manual_seed(0)
dev = C.Dev(cpu=True)
model = C.make_model(1024, 6, dev.device, fast_init=True)
opt = C.make_optimizer(model, dev)
C.fill_adam_state(model, opt)
nb = C.nbytes(C.state_tensors(model, opt))
root = tempfile.mkdtemp(dir="/dev/shm")
with CheckpointManager(root, {"model": model, "optim": opt}, compression="zstd", keep_last=1) as mgr:
    mgr.save(1)
    mgr.wait()
files = [f for f in glob.glob(root + "/**/*.zst", recursive=True)]
print(f"state {nb / 1e9:.2f} GB, files {sum(os.path.getsize(f) for f in files) / 1e9:.2f} GB")
for _ in range(3):
    with CheckpointManager(root, {"model": model, "optim": opt}, compression="zstd", keep_last=1) as mgr:
        log.clear()
        t0 = time.perf_counter()
        mgr.restore_latest()
        dt = time.perf_counter() - t0
    print(f"restore {dt:.3f} s ({nb / dt / 1e9:.2f} GB/s):", [(n, round((t - t0) * 1e3), round(d * 1e3)) for n, t, d in log])
for f in files:
    data = open(f, "rb").read()
    stored = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    t0 = time.perf_counter()
    out = fastload.decode_to_buffer("zstd", stored, None)
    dt = time.perf_counter() - t0
    print(f"{os.path.basename(f)}: decode {dt * 1e3:.0f} ms ({out.numel() / dt / 1e9:.2f} GB/s)")
    pre = torch.empty(out.numel(), dtype=torch.uint8)
    pre.fill_(1)
    t0 = time.perf_counter()
    pre.fill_(2)
    t1 = time.perf_counter()
    fresh = torch.empty(out.numel(), dtype=torch.uint8)
    fresh.fill_(1)
    t2 = time.perf_counter()
    print(f"   refill touched pages {(t1 - t0) * 1e3:.0f} ms, allocate and fill fresh ones {(t2 - t1) * 1e3:.0f} ms")
