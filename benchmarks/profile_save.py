"""Where the time of one ``maybe_save`` goes on the training thread (cProfile), for the issue-6 workload.

    PYTHONPATH=src python benchmarks/profile_save.py [--state-gb 5]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import io
import pstats
import tempfile
import time

import torch

import common as C
from checkpointd import CheckpointManager


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--state-gb", type=float, default=5.0)
    ap.add_argument("--dir", default="/dev/shm/ckd-profile")
    args = ap.parse_args()
    dev = C.Dev(cpu=not torch.cuda.is_available())
    d, layers = C.shape_for_gb(args.state_gb)
    model = C.make_model(d, layers, dev.device, fast_init=True)
    opt = C.make_optimizer(model, dev)
    C.fill_adam_state(model, opt)
    os.makedirs(args.dir, exist_ok=True)
    root = tempfile.mkdtemp(dir=args.dir if torch.cuda.is_available() else None)
    mgr = CheckpointManager(root, {"model": model, "optim": opt}, compression=None, keep_last=1)
    time.sleep(8)  # let the background pinned-buffer preparation finish
    for step in (1, 2):
        dev.sync()
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        mgr.maybe_save(step, force=True)
        prof.disable()
        dt = time.perf_counter() - t0
        mgr.wait()
        print(f"maybe_save({step}) took {dt * 1e3:.1f} ms on the training thread; stats {mgr.stats().get('last_save')}")
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(22)
        print(out.getvalue()[:6000])
    mgr.close()


if __name__ == "__main__":
    main()
