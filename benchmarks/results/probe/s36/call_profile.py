"""Session 36 probe: where maybe_save's time goes on the training thread at 20 GB (990 state tensors),
pinned and device staging, on a GPU: 6 timed calls each (device synchronised before each, one save in
flight at a time), then one call under cProfile (tottime and cumulative)."""
import cProfile, io, os, pstats, sys, tempfile, time
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "../../.."))
import torch
import common as C
from checkpointd import CheckpointManager

gb = float(sys.argv[1]) if len(sys.argv) > 1 else 20.0
dev = C.Dev(cpu=not torch.cuda.is_available())
d, layers = C.shape_for_gb(gb)
model = C.make_model(d, layers, dev.device, fast_init=True)
opt = C.make_optimizer(model, dev)
C.fill_adam_state(model, opt)
print(f"state {C.nbytes(C.state_tensors(model, opt))/1e9:.2f} GB, {len(C.state_tensors(model, opt))} state tensors", flush=True)
for mode in ("device", "pinned"):
    kw = {}
    if mode == "device":
        kw, why = C.device_staging_kwargs(None) if dev.cuda else ({}, "CPU: no device staging")
        print(why)
    root = tempfile.mkdtemp(dir="/dev/shm/ckd-call" if os.makedirs("/dev/shm/ckd-call", exist_ok=True) is None else None)
    mgr = CheckpointManager(root, {"model": model, "optim": opt}, compression=None, keep_last=1, **kw)
    time.sleep(12 if gb > 10 else 5)
    ts = []
    for step in range(1, 8):
        dev.sync()
        prof = cProfile.Profile() if step == 7 else None
        t0 = time.perf_counter()
        if prof:
            prof.enable()
        mgr.maybe_save(step, force=True)
        if prof:
            prof.disable()
        ts.append((time.perf_counter() - t0) * 1e3)
        # the next forward and optimizer step (where the hooks queue and wait for the copies)
        with torch.no_grad():
            model(torch.randn(1, 8, d, device=dev.device))
        opt.step()
        dev.sync()
        mgr.wait()
    print(f"[{mode}] call ms: " + " ".join(f"{t:.1f}" for t in ts), flush=True)
    for key in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(28)
        print(s.getvalue()[:7000], flush=True)
    mgr.close()
