"""Session 36 probe (2-core dev VM, CPU): the save call's walks timed one by one over a tiny state with
the 20 GB layout's tensor count (D=16, L=33: 1,322 tensors), medians of 50. Run from the repository root with
PYTHONPATH=src: python benchmarks/results/probe/s36/call_phases_cpu.py 33"""
import sys, time, statistics as st
import os; sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../.."))
import torch, common as C
from checkpointd import state as S, savejob as J, snapshot as N, rng
L = int(sys.argv[1]) if len(sys.argv) > 1 else 33
model = C.make_model(16, L, torch.device("cpu"), fast_init=True)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
C.fill_adam_state(model, opt)
entries = S.build_entries({"model": model, "optim": opt})
def T(f, n=50):
    ts = []
    for _ in range(n):
        t0 = time.perf_counter(); r = f(); ts.append(time.perf_counter() - t0)
    return st.median(ts) * 1e3, r
ms, trees = T(lambda: [S.entry_state(e) for e in entries]); print(f"state_dicts {ms:.2f} ms")
ms, _ = T(lambda: [S.validate_tree(t, "x", module_keys=i == 0) for i, t in enumerate(trees)]); print(f"validate {ms:.2f} ms")
ms, _ = T(lambda: S.build_files(entries, 1, {}, rng.capture_rng(), "")); print(f"build_files {ms:.2f} ms")
files = S.build_files(entries, 1, {}, rng.capture_rng(), "")
ms, (sk, tensors) = T(lambda: J.collect_tensors([f.tree for f in files])); print(f"collect_tensors {ms:.2f} ms, {len(tensors)} tensors")
ms, _ = T(lambda: J.buffers_first(entries, tensors)); print(f"buffers_first {ms:.2f} ms")
ms, _ = T(lambda: tuple(N.tensor_spec(t) for t in tensors)); print(f"tensor_spec {ms:.2f} ms")
ms, _ = T(lambda: [t.is_cuda for t in tensors]); print(f"is_cuda {ms:.2f} ms")
ms, _ = T(lambda: rng.capture_rng()); print(f"capture_rng {ms:.2f} ms")
