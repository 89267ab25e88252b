"""Distributed save benchmark: per-rank stall and aggregate write throughput, checkpointd vs DCP async_save.

    torchrun --nproc_per_node=2 benchmarks/bench_distributed.py --root /tmp/bench-dist --size-mb 64       # CPU, gloo
    torchrun --nproc_per_node=2 benchmarks/bench_distributed.py --root /tmp/bench-dist --size-mb 64 \
        --width 256 --no-dcp                                              # CPU, ~170 parameters: per-tensor overhead
    torchrun --nproc_per_node=2 benchmarks/bench_distributed.py --root /local_nvme/bench --size-mb 2048   # 2 GPUs, NCCL

Per save and rank it measures the *stall* (time inside ``maybe_save``, what the training loop loses) and
the time until the save is committed (``wait``). Aggregate throughput = bytes written by all ranks /
slowest rank's time to commit. The same model is also saved with ``torch.distributed.checkpoint.async_save``
(stall = the call, commit = ``future.result()``). Rank 0 prints one JSON line per method and setting.

Like a training loop, each save follows ``--train-steps`` optimizer steps, and the first save comes at
least ``--lead-secs`` after the manager was built (training meanwhile), so work the manager does in the
background after construction and after the first optimizer step (staging buffers) overlaps training as
it would in a real run. ``first_stall_s`` is that first save; ``stall_s`` the median of the later ones.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

from checkpointd import CheckpointManager


def build(size_mb: float, dev: torch.device, width: int = 1024) -> tuple[nn.Module, torch.optim.Optimizer]:
    layers = max(1, int(size_mb * 2**20 / 4 / 3 / (width * width)))  # params + 2 Adam moments
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]).to(dev)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    train(model, opt, 1)
    return model, opt


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    width = model[0].in_features
    dev = next(model.parameters()).device
    for _ in range(steps):
        model(torch.randn(8, width, device=dev)).sum().backward()
        opt.step()
        opt.zero_grad()


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def bench_checkpointd(root: str, model: nn.Module, opt: torch.optim.Optimizer, mode: str, compression: str | None,
                      repeats: int, dev: torch.device, train_steps: int = 2, lead_secs: float = 1.0) -> dict:
    stalls, commits, written = [], [], 0
    with CheckpointManager(root, {"model": model, "optim": opt}, mode=mode, compression=compression, keep_last=1) as mgr:
        built = time.perf_counter()
        for i in range(repeats + 1):  # the first save may allocate staging buffers: reported apart
            train(model, opt, train_steps)
            while i == 0 and time.perf_counter() - built < lead_secs:  # training goes on before the first save
                train(model, opt, 1)
            dist.barrier()
            sync(dev)
            t0 = time.perf_counter()
            mgr.save(i)
            t1 = time.perf_counter()
            mgr.wait()
            t2 = time.perf_counter()
            if i:
                stalls.append(t1 - t0)
                commits.append(t2 - t0)
            else:
                first = t1 - t0
        written = mgr.stats().get("last_save", {}).get("bytes_written", 0)
    return {"stall_s": statistics.median(stalls), "first_stall_s": first, "commit_s": statistics.median(commits), "bytes": written}


def bench_dcp(root: str, model: nn.Module, opt: torch.optim.Optimizer, repeats: int, dev: torch.device) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    stalls, commits = [], []
    for i in range(repeats + 1):
        dist.barrier()
        sync(dev)
        t0 = time.perf_counter()
        msd, osd = get_state_dict(model, opt)
        fut = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(root, f"dcp-{i}"))
        t1 = time.perf_counter()
        fut.result()
        t2 = time.perf_counter()
        if i:
            stalls.append(t1 - t0)
            commits.append(t2 - t0)
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(root, f"dcp-{repeats}")) for f in fs)
    return {"stall_s": statistics.median(stalls), "commit_s": statistics.median(commits), "bytes": size if dist.get_rank() == 0 else 0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default="/tmp/checkpointd-bench-dist")
    p.add_argument("--size-mb", type=float, default=64.0, help="model + optimizer state, all ranks together")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-dcp", action="store_true")
    p.add_argument("--width", type=int, default=1024, help="Linear layer width; smaller means more tensors for the same size")
    p.add_argument("--train-steps", type=int, default=2, help="optimizer steps before each save")
    p.add_argument("--lead-secs", type=float, default=1.0, help="least training time between building the manager and its first save")
    p.add_argument("--only", default="", help="comma-separated method names to run (default: all)")
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    # async_save needs a CPU backend beside NCCL for its background collectives.
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    model, opt = build(args.size_mb, dev, args.width)
    runs = [("checkpointd-sharded", "sharded", None), ("checkpointd-sharded-zstd", "sharded", "zstd"),
            ("checkpointd-full", "full", None)]
    results = []
    only = {x for x in args.only.split(",") if x}
    runs = [r for r in runs if not only or r[0] in only]
    for name, mode, comp in runs:
        root = os.path.join(args.root, name)
        r = bench_checkpointd(root, model, opt, mode, comp, args.repeats, dev, args.train_steps, args.lead_secs)
        results.append((name, r))
    if not args.no_dcp and (not only or "dcp-async_save" in only):
        results.append(("dcp-async_save", bench_dcp(os.path.join(args.root, "dcp"), model, opt, args.repeats, dev)))
    for name, r in results:
        per_rank = [None] * world
        dist.all_gather_object(per_rank, r)
        if rank == 0:
            total = sum(x["bytes"] for x in per_rank)
            slowest = max(x["commit_s"] for x in per_rank)
            print(json.dumps({"method": name, "world_size": world, "device": str(dev.type), "backend": dist.get_backend(),
                              "size_mb": args.size_mb, "tensors": len(list(model.parameters())), "stall_s_per_rank": [round(x["stall_s"], 4) for x in per_rank],
                              "first_stall_s_per_rank": [round(x.get("first_stall_s", 0), 4) for x in per_rank],
                              "commit_s_slowest": round(slowest, 4), "bytes_total": total,
                              "aggregate_write_GBps": round(total / slowest / 1e9, 3) if slowest else None}))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(args.root, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
