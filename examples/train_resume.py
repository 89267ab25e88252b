"""Train a small CNN, checkpoint in the background, and resume after being killed at any moment.

    python examples/train_resume.py                  # trains to --steps, checkpointing every 20 steps
    python examples/train_resume.py --kill-at 130    # dies abruptly (os._exit) at step 130 ...
    python examples/train_resume.py                  # ... and this run resumes from the newest commit

Runs on CPU or GPU (``--device cuda``). The loop calls ``mgr.maybe_save(step)`` every step; it returns
in milliseconds. Resuming is bit-exact: model, optimizer (channels_last state included), LR
scheduler, GradScaler, RNG, and a plain dict of loop counters all come back.
"""

from __future__ import annotations

import argparse
import os
import random
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from checkpointd import CheckpointManager


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.conv2(x))
        return self.head(x.mean(dim=(2, 3)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default="runs/train_resume", help="checkpoint root: a path or fsspec URL")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--every", type=int, default=20, help="checkpoint every N steps")
    ap.add_argument("--kill-at", type=int, default=None, help="simulate a crash (os._exit) at this step")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--compression", default="zstd", help="zstd, zstd-planes or none")
    args = ap.parse_args()

    torch.manual_seed(0)
    random.seed(0)
    device = torch.device(args.device)
    model = SmallCNN().to(device).to(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    scaler = torch.amp.GradScaler(device.type)
    progress = {"samples_seen": 0}

    mgr = CheckpointManager(
        args.root,
        {"model": model, "optimizer": opt, "scheduler": sched, "scaler": scaler, "progress": progress},
        every_n_steps=args.every,
        keep_last=3,
        compression=None if args.compression == "none" else args.compression,
    )
    with mgr:
        start = mgr.resume()  # the step after the newest verified checkpoint (restored in place), or 0
        print(f"{'resumed from step ' + str(start - 1) if start else 'starting fresh'}; committed steps: {mgr.steps()}")
        loss = torch.zeros(())
        t0 = time.perf_counter()
        for step in range(start, args.steps + 1):
            x = torch.randn(32, 3, 16, 16, device=device).to(memory_format=torch.channels_last)
            y = torch.randint(0, 10, (32,), device=device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            progress["samples_seen"] += x.shape[0]
            if mgr.maybe_save(step, metrics={"loss": loss.detach()}):
                print(f"step {step:4d}  loss {loss.item():.4f}  checkpoint started "
                      f"(blocked {mgr.stats()['snapshot_secs_last'] * 1e3:.1f} ms)")
            if args.kill_at is not None and step == args.kill_at:
                print(f"simulated crash at step {step}")
                os._exit(1)
        mgr.wait()
        print(f"done: {args.steps} steps in {time.perf_counter() - t0:.1f} s, final loss {loss.item():.4f}, "
              f"committed steps {mgr.steps()}, stats: {mgr.stats()['last_save']}")


if __name__ == "__main__":
    main()
