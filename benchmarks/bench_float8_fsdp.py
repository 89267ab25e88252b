"""torchao float8 training under FSDP2: checkpointd's sharded mode beside DCP on the same state; run under torchrun.

The workload: ``--layers`` square linear layers of width ``--width`` (fp32 master weights, ReLU between),
``convert_to_float8_training(..., Float8LinearConfig(enable_fsdp_float8_all_gather=True))`` (each weight a
``WeightWithDynamicFloat8CastTensor``: FSDP2 all-gathers it in float8), ``fully_shard`` per layer and on
the root, AdamW (fused on CUDA), ``precompute_float8_dynamic_scale_for_fsdp`` after every step, a batch of
``--batch`` rows per rank. Training runs over NCCL; checkpoints of both libraries talk over a gloo group.

Per method, on the same trained state (``--steps`` steps, a warm-up save waited for, one more step, the
timed save, then ``--after`` more steps):

- ``call ms``: the blocking save call (``maybe_save`` / ``async_save`` / ``save``), and ``extra ms``: the
  ``--after`` steps after it minus as many median steps (background work slowing training), rank 0;
- ``done s``: until the checkpoint is complete (committed / the future resolved), ``MB``: bytes on disk
  (all ranks), ``restore s``: into a fresh FSDP2 model and optimizer (another seed);
- ``bit-exact``: every rank's local master weights (the float8 wrapper's inner ``_tensor``), local
  subclass class, and AdamW moments equal the saved ones (``torch.equal``), and the next training step's
  loss after the restore equals the uninterrupted run's, bit for bit.

Methods: ``checkpointd`` (``CheckpointManager(dir, {"model", "optim"}, mode="sharded", compression=None)``,
pinned host staging), ``checkpointd_device`` (device staging), ``dcp_async``
(``dcp.async_save(get_state_dict(model, optim))``) and ``dcp`` (``dcp.save``, blocking).

Run (the directory must be shared by the ranks)::

    torchrun --nproc_per_node=2 benchmarks/bench_float8_fsdp.py --dir /dev/shm/f8 --json f8.json
    torchrun --nproc_per_node=2 benchmarks/bench_float8_fsdp.py --cpu --width 64 --layers 2   # gloo smoke test
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
warnings.filterwarnings("ignore", message=".*KernelPreference.*")

import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: E402
from torchao.float8.fsdp_utils import precompute_float8_dynamic_scale_for_fsdp  # noqa: E402

from checkpointd import CheckpointManager, DistributedOptions, StagingOptions  # noqa: E402

METHODS = ("checkpointd", "checkpointd_device", "dcp_async", "dcp")


class Run:
    def __init__(self, args: argparse.Namespace, seed: int) -> None:
        self.args, self.device = args, torch.device("cpu") if args.cpu else torch.device("cuda", torch.cuda.current_device())
        torch.manual_seed(seed)
        layers: list[nn.Module] = []
        for _ in range(args.layers):
            layers += [nn.Linear(args.width, args.width), nn.ReLU()]
        self.model = nn.Sequential(*layers).to(self.device)
        convert_to_float8_training(self.model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True,
                                                                           emulate=args.cpu))
        for layer in self.model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(self.model)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=not args.cpu)

    def step(self, i: int) -> float:
        g = torch.Generator(device=self.device).manual_seed(1000 * i + dist.get_rank())
        x = torch.randn(self.args.batch, self.args.width, generator=g, device=self.device)
        loss = self.model(x).float().square().mean()
        loss.backward()
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)
        precompute_float8_dynamic_scale_for_fsdp(self.model)
        return loss.detach()

    def timed_step(self, i: int) -> tuple[float, torch.Tensor]:
        t0 = time.perf_counter()
        loss = self.step(i)
        self.sync()
        return time.perf_counter() - t0, loss

    def sync(self) -> None:
        if not self.args.cpu:
            torch.cuda.synchronize()

    def local_state(self) -> dict[str, torch.Tensor]:
        """Every local master weight, bias and AdamW moment (clones), and the local weights' classes."""
        out: dict[str, Any] = {}
        for name, p in self.model.named_parameters():
            local = p._local_tensor
            out[name] = (local._tensor if hasattr(local, "_tensor") else local).detach().clone()
            out[name + ":class"] = type(local).__name__
        for p, st in self.optim.state.items():
            name = next(n for n, q in self.model.named_parameters() if q is p)
            for k, v in st.items():
                out[f"{name}:{k}"] = (v._local_tensor if hasattr(v, "_local_tensor") else v).detach().clone()
        return out


def differences(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """The keys of ``want`` that ``got`` lacks or holds other values for (the largest difference named)."""
    out = []
    for k, w in want.items():
        g = got.get(k)
        if isinstance(w, torch.Tensor) and isinstance(g, torch.Tensor) and g.shape == w.shape:
            if not torch.equal(g, w):
                out.append(f"{k} (by up to {(g.double() - w.double()).abs().max().item():.3g})")
        elif g != w:
            out.append(k)
    return out + sorted(set(got) - set(want))


def disk_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def measure(method: str, args: argparse.Namespace, gloo: Any) -> dict[str, Any]:
    rank = dist.get_rank()
    d = os.path.join(args.dir, method)
    if rank == 0:
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
    dist.barrier(gloo)
    run = Run(args, seed=0)
    times = [run.timed_step(i)[0] for i in range(args.steps)]
    median = sorted(times[2:])[len(times[2:]) // 2]
    mgr = None
    if method.startswith("checkpointd"):
        staging = StagingOptions(device_budget_bytes=64 << 30 if method == "checkpointd_device" else None)
        mgr = CheckpointManager(d, {"model": run.model, "optim": run.optim}, mode="sharded", compression=None,
                                keep_last=1, staging=staging, distributed=DistributedOptions(timeout_secs=120))

    def save(step: int) -> Any:
        if mgr is not None:
            mgr.maybe_save(step, force=True)
            return None
        msd, osd = get_state_dict(run.model, run.optim)
        if method == "dcp_async":
            return dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=d, process_group=gloo)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=d, process_group=gloo)
        return None

    # a warm-up save (the first allocates staging memory), waited for; then the timed save one step later
    warm = save(args.steps - 1)
    if mgr is not None:
        mgr.wait()
    elif warm is not None:
        warm.result()
    run.timed_step(args.steps)
    saved = run.local_state()
    t0 = time.perf_counter()
    future = save(args.steps + 1)
    call = time.perf_counter() - t0
    after = [run.timed_step(args.steps + 1 + i) for i in range(args.after)]
    extra = sum(t for t, _ in after) - len(after) * median
    if mgr is not None:
        mgr.wait()
        mgr.close()
    elif future is not None:
        future.result()
    done = time.perf_counter() - t0
    want_loss = after[0][1]
    dist.barrier(gloo)
    size = torch.tensor([disk_bytes(d) if rank == 0 else 0])

    fresh = Run(args, seed=1)  # a resumed job: built, restored before its first step
    t0 = time.perf_counter()
    if method.startswith("checkpointd"):
        with CheckpointManager(d, {"model": fresh.model, "optim": fresh.optim}, mode="sharded",
                               distributed=DistributedOptions(timeout_secs=120)) as m:
            m.restore_latest()
    else:
        msd, osd = get_state_dict(fresh.model, fresh.optim)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=d, process_group=gloo)
        set_state_dict(fresh.model, fresh.optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    fresh.sync()
    restore = time.perf_counter() - t0
    wrong = differences(fresh.local_state(), saved)
    if wrong and args.verbose:
        print(f"rank {rank} {method}: differs at {wrong[:8]}", flush=True)
    exact = not wrong
    _, loss = fresh.timed_step(args.steps + 1)
    exact = exact and torch.equal(loss, want_loss)
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, exact, group=gloo)
    return {"method": method, "call_ms": 1e3 * call, "extra_ms": 1e3 * extra, "median_step_ms": 1e3 * median,
            "done_s": done, "bytes": int(size.item()), "restore_s": restore, "bit_exact": all(flags),
            "classes": sorted({v for k, v in saved.items() if k.endswith(":class")})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--width", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--after", type=int, default=8)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--dir", default="/dev/shm/checkpointd-float8")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--verbose", action="store_true", help="name the state that differs after a restore")
    args = parser.parse_args()
    if not args.cpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("gloo" if args.cpu else "nccl", timeout=datetime.timedelta(seconds=300))
    gloo = dist.new_group(backend="gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    rows = []
    head = (f"== torchao float8 + FSDP2: torch {torch.__version__}, {world} ranks "
            f"({'cpu' if args.cpu else torch.cuda.get_device_name()}), {args.layers} x {args.width}^2 fp32 "
            f"+ AdamW, batch {args.batch}/rank\n"
            f"{'method':20} {'call ms':>8} {'extra ms':>9} {'done s':>7} {'MB':>8} {'restore s':>9}  bit-exact")
    if rank == 0:
        print(head, flush=True)
    lines = [head]
    for method in args.methods.split(","):
        try:
            row = measure(method, args, gloo)
            line = (f"{method:20} {row['call_ms']:8.1f} {row['extra_ms']:9.1f} {row['done_s']:7.2f} "
                    f"{row['bytes'] / 1e6:8.1f} {row['restore_s']:9.2f}  {row['bit_exact']}  "
                    f"(step {row['median_step_ms']:.1f} ms; {','.join(row['classes'])})")
        except Exception as exc:  # a method that cannot take this state says why in its row
            row = {"method": method, "error": f"{type(exc).__name__}: {exc}"[:400]}
            line = f"{method:20} failed: {row['error'][:200]}"
        rows.append(row)
        lines.append(line)
        if rank == 0:
            print(line, flush=True)
        dist.barrier(gloo)
    if rank == 0 and args.json:
        info = {"device": "cpu" if args.cpu else torch.cuda.get_device_name(), "ranks": world, "torch": torch.__version__,
                "cpu_count": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
                "command": f"torchrun --nproc_per_node={world} " + " ".join(sys.argv)}
        args.json.write_text(json.dumps({"info": info, "args": vars(args) | {"json": str(args.json)},
                                         "rows": rows, "table": "\n".join(lines)}, indent=2, default=str))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
