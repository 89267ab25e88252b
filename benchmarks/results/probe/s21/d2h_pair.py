"""s21e probe: device-to-host copies of one rank's state (2.42 GB) from one GPU alone and from two GPUs at once.

Why: on two GPUs each rank's snapshot copy shares the host's memory with the other's; if two copies at
once take longer than one, the per-rank stall has a floor above one GPU's with half the state.
Pinned destinations, one side stream per GPU, the copy in 80 pieces (a state's tensors), best of 5.
"""
import json, os, sys, time
import torch

nbytes = int(float(sys.argv[1]) * 1e9) if len(sys.argv) > 1 else int(2.42e9)
pieces = 80
n = torch.cuda.device_count()
src, dst, streams = [], [], []
for d in range(n):
    with torch.cuda.device(d):
        src.append(torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{d}").random_(0, 255))
        streams.append(torch.cuda.Stream(d))
    h = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    h.fill_(0)
    dst.append(h)
step = (nbytes + pieces - 1) // pieces


def enqueue(d):
    with torch.cuda.device(d), torch.cuda.stream(streams[d]):
        for a in range(0, nbytes, step):
            dst[d][a:a + step].copy_(src[d][a:a + step], non_blocking=True)


def run(devs):
    for d in range(n):
        torch.cuda.synchronize(d)
    t0 = time.perf_counter()
    for d in devs:
        enqueue(d)
    for d in devs:
        streams[d].synchronize()
    return time.perf_counter() - t0


out = {"bytes": nbytes, "gpus": n, "rows": {}}
variants = [("gpu0 alone", [0])] + ([("gpu1 alone", [1]), ("both at once", [0, 1])] if n > 1 else [])
for _ in range(5):
    for name, devs in variants:
        out["rows"].setdefault(name, []).append(round(run(devs) * 1e3, 2))
for name, ts in out["rows"].items():
    print(f"{name:14s} best {min(ts):7.2f} ms  ({nbytes / min(ts) / 1e6:.1f} GB/s a GPU)  all {ts}")
ok = all(torch.equal(dst[d][:1 << 20], src[d][:1 << 20].cpu()) for d in range(n))
print("values ok:", ok)
out["ok"] = ok
if os.environ.get("OUT"):
    json.dump(out, open(os.path.join(os.environ["OUT"], "d2h-pair-s21e.json"), "w"), indent=1)
