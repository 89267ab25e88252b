"""Where a save call's time goes, per phase, for a state of many small tensors (s13 probe).

    python3 .probe/call_phases.py --d 256 --layers 33 [--device-staging] [--saves 12] [--cpu]
"""
import argparse, cProfile, io, json, os, pstats, statistics, sys, tempfile, time
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import torch
import common as C
import checkpointd
from checkpointd import CheckpointManager, manager as M, savejob as SJ, state as ST, snapshot as SN

ap = argparse.ArgumentParser()
ap.add_argument("--d", type=int, default=256); ap.add_argument("--layers", type=int, default=33)
ap.add_argument("--device-staging", action="store_true"); ap.add_argument("--saves", type=int, default=12)
ap.add_argument("--cpu", action="store_true"); ap.add_argument("--json", default=None)
ap.add_argument("--profile", action="store_true")
args = ap.parse_args()
dev = C.Dev(cpu=args.cpu)
model = C.make_model(args.d, args.layers, dev.device, fast_init=True)
opt = C.make_optimizer(model, dev)
C.fill_adam_state(model, opt)
times: dict[str, list[float]] = {}

def wrap(mod, name, label):
    fn = getattr(mod, name)
    def w(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            times.setdefault(label, []).append(time.perf_counter() - t0)
    setattr(mod, name, w)

wrap(M, "build_files", "build_files")
wrap(ST, "validate_tree", "validate_tree")
wrap(M, "stage_save", "stage_save")
wrap(SJ, "collect_tensors", "collect_tensors")
wrap(SJ, "buffers_first", "buffers_first")
wrap(SN.Snapshotter, "snapshot", "snapshot")
wrap(SN.Snapshotter, "_stage_on_device", "stage_on_device")
if os.environ.get("WRAP_SPEC"): wrap(SN, "tensor_spec", "tensor_spec(1)")
root = tempfile.mkdtemp(dir="/dev/shm")
kw = dict(compression=None, keep_last=1)
if args.device_staging:
    kw["device_staging_budget_bytes"] = 64 << 30
mgr = CheckpointManager(root, {"model": model, "optim": opt}, **kw)
x = torch.randn(8, 64, args.d, device=dev.device)
def step():
    with torch.autocast(dev.device.type, dtype=torch.bfloat16, enabled=dev.cuda):
        loss = model(x).float().pow(2).mean()
    loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
for _ in range(3):
    step()
mgr.maybe_save(0, force=True); mgr.wait()
time.sleep(3)
calls = []
for s in range(1, args.saves + 1):
    for k in list(times):
        times[k] = times[k][:0] if s == 1 else times[k]
    step(); dev.sync()
    prof = cProfile.Profile() if (args.profile and s == args.saves) else None
    if prof: prof.enable()
    t0 = time.perf_counter()
    mgr.maybe_save(s, force=True)
    dt = time.perf_counter() - t0
    if prof: prof.disable()
    if not prof: calls.append(dt)
    step(); dev.sync(); mgr.wait()
n_t = sum(1 for _ in model.parameters())
out = {"device": dev.name, "d": args.d, "layers": args.layers, "params": n_t, "device_staging": args.device_staging,
       "call_ms_median": statistics.median(calls) * 1e3, "call_ms": [round(c * 1e3, 3) for c in calls],
       "phases_ms_median": {k: statistics.median(v) * 1e3 for k, v in times.items() if v},
       "phase_calls": {k: len(v) for k, v in times.items()}}
print(json.dumps(out))
if args.profile:
    s = io.StringIO(); pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25); print(s.getvalue()[:5000])
if args.json:
    json.dump(out, open(args.json, "w"), indent=1)
mgr.close()
