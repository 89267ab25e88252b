"""s16 probe: can the host->device copy of a mapped tmpfs file run *while* its checksum is computed?

Variants on one 4.83 GB file in /dev/shm, each with a fresh private mapping (as a restore makes):
  crc       read_file_verified (map + 16-thread CRC)                          [today's first pass]
  seq       crc, then copy_pairs(scratch <- buffer)                           [today's two passes]
  conc      read_file_verified(meanwhile = copy_pairs(scratch <- buffer))     [the overlap]
  conc_d2d  conc, then scratch -> live (device to device)                     [what a restore would do]
  conc8     conc with 8 bounce threads
  d2d       scratch -> live alone
  raw       16-thread preadv into a touched pinned buffer (the benchmark's raw ceiling)
Prints one JSON line; writes it to argv[2] if given.
"""
import json, os, sys, time, statistics
import torch
from checkpointd import fastload, bulkcopy, ptlayout

gb = float(sys.argv[1]) if len(sys.argv) > 1 else 4.83
out_path = sys.argv[2] if len(sys.argv) > 2 else None
size = int(gb * 1e9) // (1 << 20) * (1 << 20)
path = "/dev/shm/ckd-overlap.bin"
dev = torch.device("cuda")
t0 = time.perf_counter()
with open(path, "wb") as f:
    step = 256 << 20
    for a in range(0, size, step):
        n = min(step, size - a)
        f.write(torch.randn(n // 4, device=dev).cpu().numpy().tobytes())
print(f"wrote {size/1e9:.2f} GB in {time.perf_counter()-t0:.1f} s", flush=True)
scratch = torch.empty(size, dtype=torch.uint8, device=dev)
live = torch.empty(size, dtype=torch.uint8, device=dev)
pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
pinned.fill_(1)


def crc():
    buf, n, c = fastload.read_file_verified(path, size, "probe")
    return buf


def seq():
    buf = crc()
    bulkcopy.copy_pairs([(scratch, buf)])


def conc():
    fastload.read_file_verified(path, size, "probe", meanwhile=lambda b: bulkcopy.copy_pairs([(scratch, b)]))


def conc_d2d():
    conc()
    live.copy_(scratch)
    torch.cuda.synchronize()


def conc8():
    os.environ["CHECKPOINTD_RESTORE_THREADS"] = "8"
    try:
        conc()
    finally:
        del os.environ["CHECKPOINTD_RESTORE_THREADS"]


def d2d():
    live.copy_(scratch)
    torch.cuda.synchronize()


def raw():
    fd = os.open(path, os.O_RDONLY)
    try:
        view = memoryview(pinned.numpy()).cast("B")
        step = 64 << 20

        def task(a):
            b = min(size, a + step)
            got = 0
            while got < b - a:
                got += os.preadv(fd, [view[a + got:b]], a + got)
            return b - a
        ptlayout.run_tasks([lambda a=a: task(a) for a in range(0, size, step)])
    finally:
        os.close(fd)


variants = {"crc": crc, "seq": seq, "conc": conc, "conc_d2d": conc_d2d, "conc8": conc8, "d2d": d2d, "raw": raw}
times = {k: [] for k in variants}
for fn in variants.values():  # warm-up: pools, pinned chunks, kernels
    fn(); torch.cuda.synchronize()
ok = torch.equal(scratch[:1 << 20].cpu(), torch.from_file(path, size=1 << 20, dtype=torch.uint8))
for r in range(5):
    for k, fn in variants.items():
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times[k].append(round((time.perf_counter() - t) * 1e3, 1))
res = {"gb": size / 1e9, "scratch_ok": bool(ok), "io_threads": ptlayout.io_threads(),
       "crc_impl": __import__("checkpointd.crc", fromlist=["x"]).CRC32_IMPLEMENTATION,
       "card": torch.cuda.get_device_name(), "ms": times,
       "best": {k: min(v) for k, v in times.items()}, "median": {k: statistics.median(v) for k, v in times.items()}}
print(json.dumps(res), flush=True)
if out_path:
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)
os.unlink(path)
