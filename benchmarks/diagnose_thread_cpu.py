"""What a save costs the training process's own threads: CPU time and context switches per thread, per save.

Why: where the training loop is CPU-bound (FSDP2 on several GPUs, launch-bound small models), the
training thread feels every millisecond that another thread of its process holds the GIL, and every
switch of the GIL between threads. The stall benchmarks measure the sum; this shows who in the process
does what. Each thread's CPU time comes from its own clock (``pthread_getcpuclockid``), its switches
from ``/proc/self/task/<tid>/status`` (voluntary + involuntary), taken before a save's step and after
``wait()``, with training steps running meanwhile. The persist process's work is not in these numbers
(it has its own process, GIL and lower priority).

    torchrun --nproc_per_node=2 benchmarks/diagnose_thread_cpu.py [--state-gb 5] [--saves 6] [--json out.json]
    python benchmarks/diagnose_thread_cpu.py --cpu --tiny          (one process, CPU: a smoke test)

Under ``torchrun`` the model is wrapped with FSDP2 (``fully_shard`` per block and root) and saved in
sharded mode, as ``bench_stall_dist.py`` does; without it, one process and full mode. Rank 0 prints one
line per save.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import sys
import threading
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402
from checkpointd import CheckpointManager  # noqa: E402


def thread_clocks() -> dict[tuple[str, int], tuple[float, int]]:
    """(thread name, ident) -> (CPU seconds, context switches) for every Python thread of this process."""
    out = {}
    for t in threading.enumerate():
        try:
            cpu = time.clock_gettime(time.pthread_getcpuclockid(t.ident))  # type: ignore[arg-type]
            with open(f"/proc/self/task/{t.native_id}/status") as f:
                switches = sum(int(line.split()[1]) for line in f if line.startswith(("voluntary_ctxt", "nonvoluntary_ctxt")))
        except (OSError, ValueError, TypeError, AttributeError):
            continue
        out[(t.name, t.ident)] = (cpu, switches)  # type: ignore[index]
    return out


def per_name(before: dict, after: dict) -> tuple[dict[str, float], dict[str, int]]:
    """CPU ms and switches between two :func:`thread_clocks`, summed over threads of one name (pool
    threads' numbers stripped)."""
    cpu: collections.Counter = collections.Counter()
    switches: collections.Counter = collections.Counter()
    for key, (c, s) in after.items():
        c0, s0 = before.get(key, (0.0, 0))
        name = key[0].rstrip("0123456789_")
        cpu[name] += 1e3 * (c - c0)
        switches[name] += s - s0
    return ({k: round(v, 2) for k, v in cpu.most_common() if v >= 0.01}, dict(switches.most_common()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="D=64, L=2, B=2, S=32 (smoke test)")
    ap.add_argument("--state-gb", type=float, default=5.0, help="total over the ranks (bench_stall presets)")
    ap.add_argument("--saves", type=int, default=6)
    ap.add_argument("--every", type=int, default=30, help="training steps between saves")
    ap.add_argument("--B", type=int, default=8)
    ap.add_argument("--S", type=int, default=512)
    ap.add_argument("--dir", default="/dev/shm/ckd-thread-cpu")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    distributed = "RANK" in os.environ
    cuda = torch.cuda.is_available() and not a.cpu
    rank = int(os.environ.get("RANK", "0"))
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if distributed:
        dist.init_process_group("nccl" if cuda else "gloo")
    dev = C.Dev(cpu=not cuda)
    d, layers = (64, 2) if a.tiny else C.shape_for_gb(a.state_gb)
    b, s = (2, 32) if a.tiny else (a.B, a.S)
    model = C.make_model(d, layers, dev.device)
    if distributed:
        from torch.distributed.fsdp import fully_shard  # noqa: PLC0415
        for block in model:
            fully_shard(block)
        fully_shard(model)
    opt = C.make_optimizer(model, dev)
    x = torch.randn(b, s, d, device=dev.device)

    def step() -> None:
        with torch.autocast(dev.device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dev.sync()

    for _ in range(3):
        step()
    if rank == 0:
        shutil.rmtree(a.dir, ignore_errors=True)
        os.makedirs(a.dir)
    if distributed:
        dist.barrier()
    mode = "sharded" if distributed else "full"
    rows = []
    with CheckpointManager(a.dir, {"model": model, "optim": opt}, mode=mode, compression=None, keep_last=1,
                           max_pending=1) as mgr:
        time.sleep(1.0)  # the staging arena's background preparation
        for k in range(1, a.saves + 1):
            for _ in range(a.every - 1):
                step()
            before, wall0 = thread_clocks(), time.perf_counter()
            step()
            t0 = time.perf_counter()
            mgr.maybe_save(k * a.every, force=True)
            call = time.perf_counter() - t0
            steps = 0
            while mgr.stats().get("saves_pending", 0) and steps < 500:  # training goes on while it is written
                step()
                steps += 1
            mgr.wait()
            cpu_ms, switches = per_name(before, thread_clocks())
            rows.append({"save": k, "call_ms": round(1e3 * call, 2), "steps_while_saving": steps,
                         "wall_ms": round(1e3 * (time.perf_counter() - wall0), 1), "cpu_ms": cpu_ms, "switches": switches})
            if rank == 0:
                print(json.dumps(rows[-1]), flush=True)
    if rank == 0:
        shutil.rmtree(a.dir, ignore_errors=True)
        if a.json:
            C.write_json(a.json, {"info": C.env_info(dev), "mode": mode, "D": d, "L": layers, "saves": rows})
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
