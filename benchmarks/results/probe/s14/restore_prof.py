"""One restore_latest profiled (s14): build the 5 GB state, save once, restore N times, profile the last."""
import cProfile, io, os, pstats, sys, time, tempfile, shutil
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import torch
import common as C
import bench_restore as BR
import checkpointd
print("library", checkpointd.__file__)
gb = float(sys.argv[1]) if len(sys.argv) > 1 else 5.0
dev = C.Dev(cpu=not torch.cuda.is_available())
model, opt, st = C.build_train_state(gb, None, None, dev, on="device")
root = "/dev/shm/ckd-rprof"; shutil.rmtree(root, ignore_errors=True)
with C.make_manager(root, {"model": model, "optim": opt}, notes=[], keep_last=None, compression=None) as mgr:
    mgr.maybe_save(1, force=True); mgr.wait()
for i in range(4):
    BR.zero_live(C.state_tensors(model, opt), dev)
    C.collect()
    mgr = C.make_manager(root, {"model": model, "optim": opt}, keep_last=None, compression=None)
    prof = cProfile.Profile() if i == 3 else None
    dev.sync(); t0 = time.perf_counter()
    if prof: prof.enable()
    step = mgr.restore_latest(); dev.sync()
    if prof: prof.disable()
    print(f"restore {i}: {time.perf_counter() - t0:.3f} s step {step}", flush=True)
    mgr.close()
s = io.StringIO(); pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(30); print(s.getvalue()[:6000])
s = io.StringIO(); pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(15); print(s.getvalue()[:3000])
shutil.rmtree(root, ignore_errors=True)
