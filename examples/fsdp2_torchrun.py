"""Train a small FSDP2 model with asynchronous checkpoints; stop it anywhere and run it again to resume.

    torchrun --nproc_per_node=2 examples/fsdp2_torchrun.py --root /tmp/fsdp2-ckpt            # CPU: gloo
    torchrun --nproc_per_node=2 examples/fsdp2_torchrun.py --root /tmp/fsdp2-ckpt --mode full
    # GPUs: the same command; NCCL and one GPU per rank are picked when CUDA is available.

Every rank builds the manager and calls ``maybe_save``/``restore_latest`` with the same steps. In
``sharded`` mode each rank writes its own shard file; a restart may use a different ``--nproc_per_node``
(the checkpoint is resharded on restore).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

from checkpointd import CheckpointManager


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default="/tmp/checkpointd-fsdp2")
    parser.add_argument("--mode", choices=["sharded", "full"], default="sharded")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(args.width, args.width), nn.GELU(), nn.Linear(args.width, 10)).to(dev)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=20)

    with CheckpointManager(args.root, {"model": model, "optim": opt, "sched": sched},
                           mode=args.mode, every_n_steps=args.every, keep_last=2) as mgr:
        start = mgr.restore_latest()
        first = 0 if start is None else start + 1
        if rank == 0:
            print(f"world size {dist.get_world_size()}, mode {args.mode}: " + ("fresh start" if start is None else f"resumed from step {start}"))
        torch.manual_seed(1234 + rank)
        for step in range(first, args.steps + 1):
            x = torch.randn(32, args.width, device=dev)
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            if mgr.maybe_save(step, metrics={"loss": loss.item()}) and rank == 0:
                print(f"step {step}: checkpoint started (loss {loss.item():.4f})")
        mgr.wait()
        if rank == 0:
            print(f"committed steps: {mgr.steps()}; last save: {mgr.stats().get('last_save')}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
