"""Is the first device-to-host copy into a freshly registered staging arena slower, and does a warm-up help?

Each trial: a fresh StagingArena (registered, shared, as the library makes it), a warm-up variant, then
three copies of the whole state on one side stream (GPU time by events). Variants alternate.
"""
import json, os, sys, time
import torch
from checkpointd.snapshot import StagingArena, tensor_spec

gb = float(sys.argv[1]) if len(sys.argv) > 1 else 2.42
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
dev = torch.device("cuda")
n = 120
per = int(gb * 1e9 / n) // 4
srcs = [torch.randn(per, device=dev) for _ in range(n)]
specs = [tensor_spec(t) for t in srcs]
torch.cuda.synchronize()

def copy_all(arena, stream):
    with torch.cuda.stream(stream):
        s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)
        s.record(stream)
        for src, dst in zip(srcs, arena.buffers):
            dst.copy_(src, non_blocking=True)
        e.record(stream)
    e.synchronize()
    return s.elapsed_time(e)

def warm(arena, how, stream):
    t0 = time.perf_counter()
    flat = arena._slab
    if how == "tiny":
        scratch = torch.empty(4096, dtype=torch.uint8, device=dev)
        with torch.cuda.stream(stream):
            flat[:4096].copy_(scratch, non_blocking=True)
    elif how in ("full_d2h", "full_h2d"):
        chunk = 64 << 20
        scratch = torch.zeros(chunk, dtype=torch.uint8, device=dev)
        with torch.cuda.stream(stream):
            for off in range(0, flat.numel(), chunk):
                m = min(chunk, flat.numel() - off)
                if how == "full_d2h":
                    flat[off:off + m].copy_(scratch[:m], non_blocking=True)
                else:
                    scratch[:m].copy_(flat[off:off + m], non_blocking=True)
    stream.synchronize()
    return (time.perf_counter() - t0) * 1e3

rows = []
variants = ["none", "tiny", "full_d2h", "full_h2d"]
for r in range(reps):
    for how in variants:
        t0 = time.perf_counter()
        arena = StagingArena(specs, pin=True)
        reg = time.perf_counter() - t0
        stream = torch.cuda.Stream()
        w = warm(arena, how, stream)
        times = [copy_all(arena, stream) for _ in range(3)]
        rows.append(dict(rep=r, warm=how, register_s=round(reg, 3), warm_ms=round(w, 1), copies_ms=[round(x, 2) for x in times], pinned=arena.pinned, shared=arena._shared is not None))
        print(rows[-1], flush=True)
        arena.release(); del arena
summary = {}
for how in variants:
    firsts = [x["copies_ms"][0] for x in rows if x["warm"] == how]
    rest = [c for x in rows if x["warm"] == how for c in x["copies_ms"][1:]]
    summary[how] = dict(first_mean=round(sum(firsts)/len(firsts), 2), later_mean=round(sum(rest)/len(rest), 2))
print(json.dumps(summary))
out = os.environ.get("OUT")
if out:
    json.dump(dict(gb=gb, rows=rows, summary=summary, card=torch.cuda.get_device_name()), open(f"{out}/first-copy-{gb}.json", "w"), indent=1)
