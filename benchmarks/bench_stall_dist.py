"""Training stall per checkpoint on N ranks (FSDP2, sharded checkpoints), per rank; run under torchrun.

The target: on two GPUs (FSDP2, sharded mode) the per-rank stall is about that of one GPU with half the
state. This is ``bench_stall.py``'s measurement, unchanged, on every rank of a ``torchrun`` job:

- workload: ``bench_stall``'s, identical for a given ``D, L, B, S`` (``common.make_model``: L transformer
  blocks of width D, fp32 parameters, AdamW fused on CUDA, bf16 autocast, input B x S x D per rank),
  wrapped with FSDP2: ``fully_shard`` on every block, then on the root. Each rank holds 1/N of the
  parameters and AdamW moments. ``--state-gb`` is the total over the ranks (same presets as
  ``bench_stall``: 5 -> D=2048, L=8);
- the loop: ``bench_stall.Bench.run`` itself (every step ends with ``torch.cuda.synchronize()``, a save
  step also synchronizes before the save call, so the call is timed alone). Each rank times its own steps;
  nothing in the timed loop synchronizes ranks except what training does (FSDP's all-gathers and
  reduce-scatters); barriers on a gloo group separate the methods only;
- stall, defined: per checkpoint, the sum over the save step and the 20 steps after it of (step
  time - median step time of this rank's own ``none`` runs, pooled); mean, min, max over the checkpoints,
  the first included (``bench_stall.analyse``, per rank).

Methods (``--methods``, default ``none,checkpointd,dcp_async,none``):

| method | what runs |
|---|---|
| ``none`` | no checkpointing (run first and last: the baseline, and drift) |
| ``checkpointd`` | ``CheckpointManager(dir, {"model", "optim"}, mode="sharded", compression=None, every_n_steps=EVERY, keep_last=1, max_pending=1)``, ``maybe_save(step)`` every step |
| ``checkpointd_zstd`` | the same with ``compression="zstd"`` |
| ``checkpointd_device`` | the same plus device staging (CUDA only; as ``bench_stall``) |
| ``checkpointd_threads`` | ``checkpointd`` with ``CHECKPOINTD_PERSIST_PROCESS=0`` (files written by threads of the rank's process) |
| ``dcp_async`` | ``dcp.async_save({"model": msd, "optim": osd}, process_group=<dedicated gloo group>)`` with ``msd, osd = get_state_dict(model, optim)`` in the timed call, default stager; the previous save is waited for first (``bench_stall``'s ``dcp_async``) |
| ``dcp_async_pinned`` | the same with ``DefaultStager(StagingOptions(True, False, True, True))``, staging waited for before ``optimizer.step()`` |

Rank 0 gathers every rank's runs and prints one table: rank, method, stall ms mean [min, max], first,
steady-state ratio (``steady x``: mean step time between checkpoints / ``none`` on the same steps), the
save call's time (``save ms`` mean, ``save 1st``), the median step time; with ``--json`` it writes every
rank's step times, saves, stalls and checkpointd ``stats()`` plus ``stall_by_rank``.

**The comparison** is ``bench_stall.py`` on one GPU with half the state: ``--state-gb`` = half of
this run's (``--state-gb 5`` here on 2 GPUs, D=2048 L=8, against ``--state-gb 2.5`` there, D=2048 L=4,
the same per-GPU state and batch). The exact single-GPU command (``--D/--L`` with L/N layers) is printed in
the header; pass its JSON with ``--ref-json`` to get its rows (``1gpu``) and the ``x 1gpu`` column (this
rank's mean stall / the single GPU's, same method) in the table. Per-rank compute is that of L layers (FSDP
runs every layer on every rank), not L/N, so compare stalls, not step times.

Run (2 GPUs, NCCL for training, each rank on cuda:LOCAL_RANK; the checkpoint dir must be shared by the ranks):

    M=none,checkpointd,none,checkpointd,none,checkpointd,none
    CUDA_VISIBLE_DEVICES=0 python benchmarks/bench_stall.py --state-gb 2.5 --every 60 --ckpts 6 \\
        --methods $M --dir /dev/shm/ckd-1 --json stall_1gpu.json     # the reference, one GPU
    torchrun --nproc_per_node=2 benchmarks/bench_stall_dist.py --state-gb 5 --every 60 --ckpts 6 \\
        --methods $M --dir /dev/shm/ckd-dist --ref-json stall_1gpu.json --json stall_dist.json

Why interleaved (``checkpointd`` three times between ``none`` runs): the two-GPU loop's median step
wanders by several ms within the process (46-72 ms in 30-step blocks of one ``none`` run on 2x H200),
so one pooled baseline biases a 21-step window by up to hundreds of ms. The ``interleaved`` lines under
the table score each window against the ``none`` runs beside its run and give the mean with its 95 %
confidence interval, the placebo beside it (``bench_stall.interleaved_summary``); ``paired`` there is
the drift-free estimate (each window minus one halfway to the next save). ``dcp_async`` can be added.

CPU smoke test (gloo; timings mean nothing):

    torchrun --nproc_per_node=2 benchmarks/bench_stall_dist.py --cpu --tiny

``DIST_TIMEOUT_S`` (default 600): the timeout of every process group (training, DCP, barriers), so a rank left
waiting in a collective by a failed one errors out instead of hanging (torchrun also stops the others).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_stall as S  # noqa: E402
import common as C  # noqa: E402

WINDOW = S.WINDOW
DEFAULT_METHODS = ["none", "checkpointd", "copy_only", "io_only_reuse", "dcp_async", "none"]


class Ctx:
    """Rank, world size, device, and the gloo groups this script uses besides the training group."""

    def __init__(self, cpu: bool):
        self.cuda = torch.cuda.is_available() and not cpu
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        timeout = timedelta(seconds=C.env_float("DIST_TIMEOUT_S", 600.0) or 600.0)
        if self.cuda:
            torch.cuda.set_device(self.local_rank)
            dist.init_process_group("nccl", timeout=timeout, device_id=torch.device("cuda", self.local_rank))
        else:
            dist.init_process_group("gloo", timeout=timeout)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.backend = str(dist.get_backend())
        self.ctl = dist.new_group(backend="gloo", timeout=timeout)  # barriers between methods, gathering results
        self.dcp = dist.new_group(backend="gloo", timeout=timeout)  # DCP's async_save (its background collectives)
        self.dev = C.Dev(cpu=not self.cuda)
        if self.cuda:
            self.dev.device = torch.device("cuda", self.local_rank)

    def barrier(self) -> None:
        dist.barrier(group=self.ctl)

    def gather(self, obj: Any) -> list[Any] | None:
        out = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.ctl)
        return out


def local_tensors(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    """This rank's shards (DTensor.to_local) of the state tensors."""
    return [t.to_local() if hasattr(t, "to_local") else t for t in ts]


# ----------------------------------------------------------------------------------------------------
# savers: bench_stall's, with the distributed differences (sharded manager, DCP on a gloo group). Every
# setup starts with a barrier: all ranks have emptied the method's directory before anyone writes there.


class _Sharded:
    """Turns a bench_stall checkpointd saver into its sharded-mode, barrier-first twin."""

    def kwargs(self):
        kw = super().kwargs()  # type: ignore[misc]
        return None if kw is None else {**kw, "mode": "sharded"}

    def setup(self):
        self.b.ctx.barrier()  # type: ignore[attr-defined]
        super().setup()  # type: ignore[misc]


class DistCheckpointd(_Sharded, S.Checkpointd):
    pass


class DistCheckpointdZstd(_Sharded, S.CheckpointdZstd):
    pass


class DistCheckpointdDevice(_Sharded, S.CheckpointdDevice):
    pass


class DistCheckpointdThreads(_Sharded, S.CheckpointdThreads):
    """Sharded checkpointd with the persist process off (bench_stall's checkpointd_threads)."""


class DistDcpAsync(S.DcpAsync):
    """bench_stall's dcp_async: get_state_dict + async_save on a dedicated gloo group; one save in flight."""

    name = "dcp_async"

    def setup(self):
        self.b.ctx.barrier()
        super().setup()
        from torch.distributed.checkpoint.state_dict import get_state_dict  # noqa: PLC0415
        self.get_state_dict = get_state_dict

    def _async_save(self, d):
        msd, osd = self.get_state_dict(self.b.model, self.b.opt)
        return self.dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=d, process_group=self.b.ctx.dcp, **self.kw)


class DistDcpAsyncPinned(DistDcpAsync):
    name = "dcp_async_pinned"
    pinned = True


DIST_SAVERS = {c.name: c for c in [S.Saver, DistCheckpointd, DistCheckpointdZstd, DistCheckpointdDevice,
                                   DistCheckpointdThreads, DistDcpAsync, DistDcpAsyncPinned, S.IoOnly,
                                   S.IoOnlyReuse, S.CopyOnly]}
# bench_stall.Bench.run looks its saver up in bench_stall.SAVERS: in this process, these replace them.
S.SAVERS.clear()
S.SAVERS.update(DIST_SAVERS)


class DistBench(S.Bench):
    """bench_stall.Bench with the model wrapped by FSDP2 (same construction order, seeds and input)."""

    def __init__(self, args, ctx: Ctx):
        self.ctx = ctx
        super().__init__(args, ctx.dev)

    def wrap(self, model):
        for block in model:
            fully_shard(block)
        fully_shard(model)
        return model


# ----------------------------------------------------------------------------------------------------
# report


def stall_summary(r: dict) -> dict | None:
    s = r.get("stall_ms") or []
    if not s:
        return None
    b = r.get("block_s") or []
    return {"mean": sum(s) / len(s), "min": min(s), "max": max(s), "first": s[0], "stall_ms": s,
            "save_call_ms": 1e3 * sum(b) / len(b) if b else None, "save_call_first_ms": 1e3 * b[0] if b else None,
            "steady_mean_ratio": r.get("steady_mean_ratio"), "median_step_ms": r.get("median_step_ms"),
            "local_mean": (sum(r["stall_local_ms"]) / len(r["stall_local_ms"])) if r.get("stall_local_ms") else None}


def load_ref(path: str | None) -> dict | None:
    if not path:
        return None
    with open(path) as f:
        return json.load(f)


def summarise(res: dict) -> str:
    ref = res.get("ref")
    ref_runs = {r["method"]: r for r in (ref or {}).get("runs", [])}
    rows = []
    methods: list[str] = []
    for rk in res["ranks"]:
        for r in rk["runs"]:
            if r["method"] not in methods:
                methods.append(r["method"])

    def row(rank: str, r: dict, base: dict | None) -> dict:
        out: dict[str, Any] = {"rank": rank, "method": r["method"]}
        if "skipped" in r:
            out["note"] = "skipped: " + r["skipped"]
            return out
        sm = stall_summary(r)
        p = r.get("placebo_ms") or []
        if p and not sm:  # a `none` run scored with the checkpoints' windows: the host's own noise
            out["stall"] = f"{sum(p) / len(p):.1f} [{min(p):.1f}, {max(p):.1f}]"
            out["first"] = C.fmt(p[0])
            out["note"] = "placebo: no checkpoint, the same windows"
        if sm:
            out["stall"] = f"{sm['mean']:.1f} [{sm['min']:.1f}, {sm['max']:.1f}]"
            out["first"] = C.fmt(sm["first"])
            out["local"] = C.fmt(sm["local_mean"])
            out["block"] = C.fmt(sm["save_call_ms"], ".1f")
            out["bfirst"] = C.fmt(sm["save_call_first_ms"], ".1f")
            bs = stall_summary(base) if base else None
            if bs and bs["mean"] > 0:
                out["xref"] = C.fmt(sm["mean"] / bs["mean"], ".2f")
        pair = r.get("stall_paired_ms") or []
        if pair:
            out["paired"] = C.fmt(sum(pair) / len(pair))
        if "steady_mean_ratio" in r:
            out["steady"] = C.fmt(r["steady_mean_ratio"], ".3f")
        if "median_step_ms" in r:
            out["med"] = C.fmt(r["median_step_ms"], ".2f")
        S.persist_and_notes(r, out, 100)
        return out

    for m in methods:
        for rk in res["ranks"]:
            r = next((x for x in rk["runs"] if x["method"] == m), None)
            if r is not None:
                rows.append(row(str(rk["rank"]), r, ref_runs.get(m)))
        if m in ref_runs:
            rows.append(row("1gpu", ref_runs[m], None))
    cols = [("rank", "rank"), ("method", "method"), ("stall", "stall ms mean [min, max]"), ("first", "first"),
            ("local", "local"), ("paired", "paired"), ("steady", "steady x"), ("block", "save ms"), ("bfirst", "save 1st"), ("med", "step ms"),
            ("persist", "persist s"), ("writes", "write s 1st/last [recycled]"), ("xref", "x 1gpu"), ("note", "note")]
    i, w = res["info"], res["workload"]
    head = (f"\n== stall, {w['world_size']} ranks ({i['backend']}, FSDP2): {i['device']}, torch {i['torch']}, {i['date']}\n"
            f"   D={w['D']} L={w['L']} B={w['B']} S={w['S']} per rank: {w['params'] / 1e6:.1f}M params, state "
            f"{w['state_bytes_total'] / 1e9:.3f} GB total, {w['state_bytes_per_rank'] / 1e9:.3f} GB per rank in "
            f"{w['tensors']} tensors; {w['ckpts']} checkpoints every {w['every']} steps, {w['steps']} steps/method; "
            f"dir {w['dir']} ({w['dir_fs']})\n")
    fl = res.get("floor") or []
    if fl:
        head += "   fwd+bwd ms per rank: " + ", ".join(C.fmt(f.get("fwdbwd_ms"), ".1f") for f in fl)
        if fl[0].get("d2h_pinned_GBps") is not None:
            head += ("; pinned D2H GB/s per rank (all ranks at once): "
                     + ", ".join(C.fmt(f.get("d2h_pinned_GBps"), ".1f") for f in fl))
        head += "\n"
    head += f"   single-GPU reference (half the state): {res['ref_command']}\n"
    if ref:
        rw = ref["workload"]
        head += (f"   1gpu rows from {res['ref_path']}: {ref['info'].get('device')}, D={rw['D']} L={rw['L']} B={rw['B']} "
                 f"S={rw['S']}, state {rw['state_bytes'] / 1e9:.3f} GB\n")
    head += ("   stall = sum over the save step + 20 steps of (step - median step of this rank's `none` runs), mean "
             "[min, max] over checkpoints, first included; local = the same windows against the median of the 20 steps\n"
             "   before each save (blind to drift between runs; a diagnostic, not the verdict); paired = each window minus the window\n"
             "   halfway to the next save in the same run (drift and the host's own stalls cancel; a diagnostic); on `none` rows the\n"
             "   checkpoints' windows of a run without checkpoints (placebo);\n"
             "   steady x = mean step between checkpoints / `none` on the same steps; save ms = time inside the save call; "
             "x 1gpu = mean stall / the single GPU's\n"
             "   " + S.WRITES_LEGEND)
    warnings = drift_warnings(res) + [f"rank {rk['rank']}: {w}" for rk in res.get("ranks", [])
                                      if (w := S.outside_warning(rk["runs"]))]
    profiles = [f"rank {rk['rank']} " + text for rk in res["ranks"] if (text := S.slow_step_lines(rk["runs"]))]
    inter = [text for rk in res["ranks"] if (text := S.interleaved_lines(S.interleaved_summary(rk["runs"]), f", rank {rk['rank']}"))]
    if ref and (text := S.interleaved_lines(S.interleaved_summary(ref.get("runs", [])), ", 1gpu (half the state)")):
        inter.append(text)
    return (head + C.table(rows, [c for c in cols if any(c[0] in r for r in rows)])
            + "".join("\n" + w for w in warnings) + "".join("\n" + p for p in profiles) + "".join("\n" + t for t in inter))


def drift_warnings(res: dict) -> list[str]:
    """``bench_stall.drift_warning`` for each rank's runs: FSDP2 loops drift more than one GPU's
    (on 2x H200 the median step can move between 44.3 and 51.9 ms within one run)."""
    return [f"rank {rk['rank']}: {w}" for rk in res.get("ranks", []) if (w := S.drift_warning(rk["runs"]))]


# ----------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="CPU and gloo even if CUDA is available")
    C.add_prefault_arg(p)
    p.add_argument("--step-counters", action="store_true", default=bool(C.env_int("STEP_COUNTERS", 0)),
                   help="record kernel counters per step on every rank (see bench_stall.py)")
    p.add_argument("--tiny", action="store_true", help="tiny sizes (smoke test)")
    p.add_argument("--state-gb", type=float, default=C.env_float("STATE_GB", None),
                   help="total state over all ranks: 0.5, 5 or 20 (presets of bench_stall), else L at D=2048")
    p.add_argument("--D", type=int, default=None)
    p.add_argument("--L", type=int, default=None)
    p.add_argument("--B", type=int, default=None, help="batch per rank (default 8)")
    p.add_argument("--S", type=int, default=None)
    p.add_argument("--every", type=int, default=None, help="checkpoint every N steps (default 100; tiny 25)")
    p.add_argument("--ckpts", type=int, default=3, help="checkpoints per method (>= 3)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per method (default (ckpts+1)*every - 1)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS), help="comma list from: " + ", ".join(DIST_SAVERS))
    p.add_argument("--dir", default="/dev/shm/ckd-dist", help="checkpoint root shared by the ranks (a subdirectory per method)")
    p.add_argument("--keep-last", type=int, default=1)
    p.add_argument("--max-pending", type=int, default=1)
    p.add_argument("--ckd-kwargs", default=None, help="JSON object of extra CheckpointManager kwargs")
    p.add_argument("--device-kwargs", default=None, help="JSON object of kwargs for checkpointd_device")
    p.add_argument("--ref-json", default=None, help="bench_stall.py JSON of the single-GPU reference (half the state)")
    p.add_argument("--json", default=None, help="write all results here (rank 0)")
    a = p.parse_args(argv)
    if a.ckpts < 3:
        p.error("--ckpts must be >= 3")
    return S.resolve_args(p, a, DIST_SAVERS)


def ref_command(args, world: int) -> str:
    if args.L % world == 0:
        shape = f"--D {args.D} --L {args.L // world}"
    else:
        shape = f"--D {args.D} --L {args.L} (L not divisible by {world}: pick --L for 1/{world} of the state)"
    return (f"python benchmarks/bench_stall.py {'--cpu ' if args.cpu else ''}{shape} --B {args.B} --S {args.S} "
            f"--every {args.every} --ckpts {args.ckpts} --steps {args.steps} --methods {','.join(args.methods)}"
            + (f" (--state-gb {args.state_gb / world:g})" if args.state_gb else ""))


def main(argv=None):
    args = parse_args(argv)
    # Before the process group forms, on one process per host: the other ranks wait in the rendezvous
    # meanwhile, so they allocate nothing beside the blocks being written.
    prefault = {"gib": 0, "note": "done by local rank 0"}
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        prefault = C.prefault_host_memory(args.prefault_gb, C.Dev(cpu=args.cpu))
    ctx = Ctx(cpu=args.cpu)
    try:
        return _main(args, ctx, prefault)
    finally:
        # The persist process is shut down here, not by its atexit hook: with an `io_only*` method (which
        # drives it directly) as its last user on gloo, leaving it to that hook can abort both ranks in the
        # interpreter's teardown, after every atexit handler ran ("terminate called without an active
        # exception"; CPU, torch 2.13).
        from checkpointd.storage import persist_process  # noqa: PLC0415

        persist_process.shutdown()
        dist.destroy_process_group()


def _main(args, ctx: Ctx, prefault: dict):
    rank0 = ctx.rank == 0
    b = DistBench(args, ctx)
    b.steps = args.steps
    info = C.env_info(b.dev)
    info.update(world_size=ctx.world, backend=ctx.backend, prefault=prefault)
    if rank0:
        print(f"[stall-dist] {ctx.world} ranks, {ctx.backend}, {info['device']}  torch {info['torch']}  "
              f"checkpointd {info['checkpointd']}", flush=True)
        if not b.dev.cuda:
            print("[stall-dist] CPU mode: a smoke test of the script; its timings mean nothing", flush=True)
        os.makedirs(args.dir, exist_ok=True)
    b.warmup(args.warmup)
    ts = C.state_tensors(b.model, b.opt)
    sb_local = C.nbytes(local_tensors(ts))
    sb_total = C.nbytes(ts)  # DTensor numel is the global one
    workload = {"D": args.D, "L": args.L, "B": args.B, "S": args.S, "params": sum(p.numel() for p in b.model.parameters()),
                "state_bytes_total": sb_total, "state_bytes_per_rank": sb_local, "tensors": len(ts),
                "every": args.every, "ckpts": args.ckpts, "steps": args.steps, "dir": args.dir,
                "dir_fs": C.fs_type(args.dir), "amp": "bf16", "fused_adamw": b.dev.cuda, "world_size": ctx.world,
                "fsdp": "fully_shard per block + root"}
    floor = b.floor(sb_local)
    floors = ctx.gather(floor)
    res: dict[str, Any] = {"info": info, "workload": workload, "floor": floors, "runs_note":
                           "ranks[i].runs: bench_stall.Bench.run per rank, stalls against that rank's `none` runs",
                           "ranks": [], "stall_by_rank": {}, "complete": False,
                           "ref_command": ref_command(args, ctx.world), "ref_path": args.ref_json}
    if rank0:
        res["ref"] = load_ref(args.ref_json)
        print(f"[stall-dist] state {sb_total / 1e9:.3f} GB total, {sb_local / 1e9:.3f} GB per rank; D={args.D} L={args.L} "
              f"B={args.B} S={args.S}; floor {floors}", flush=True)
    runs: list[dict] = []
    counts: dict[str, int] = {}
    for k, m in enumerate(args.methods):
        b.dir = os.path.join(args.dir, f"{k:02d}-{m}")
        if rank0:
            C.clean_dir(b.dir)
        ctx.barrier()
        t0 = time.perf_counter()
        r = b.run(m)  # Bench.run empties b.dir on every rank; the savers' setup waits for all ranks
        counts[m] = counts.get(m, 0) + 1
        if counts[m] > 1:
            r["method"] = f"{m}#{counts[m]}"
        r["wall_s"] = time.perf_counter() - t0
        r["rank"] = ctx.rank
        runs.append(r)
        S.analyse(runs, args.every, args.steps)
        ctx.barrier()
        if rank0:
            shutil.rmtree(b.dir, ignore_errors=True)
        everyone = ctx.gather(runs)
        if rank0:
            res["ranks"] = [{"rank": i, "runs": rr} for i, rr in enumerate(everyone)]
            res["stall_by_rank"] = {x["method"]: [dict(rank=i, **(stall_summary(rr[j]) or {}))
                                                  for i, rr in enumerate(everyone)]
                                    for j, x in enumerate(everyone[0]) if stall_summary(x)}
            C.write_json(args.json, res, quiet=True)
            brief = [{kk: rr[-1].get(kk) for kk in ("stall_ms", "block_s", "steady_mean_ratio", "error", "skipped")
                      if rr[-1].get(kk) is not None} for rr in everyone]
            print(f"[stall-dist] {r['method']} ({r['wall_s']:.1f} s): " + "; ".join(
                f"rank {i} {C.jsonable(x)}" for i, x in enumerate(brief)), flush=True)
    ctx.barrier()
    if rank0:
        text = summarise(res)
        stats = S.ckd_stats_lines(res["ranks"][0]["runs"])
        res["table"] = text + ("\n   rank 0:\n" + stats if stats else "")
        res["drift_warning"] = drift_warnings(res) or None
        res["interleaved_by_rank"] = [S.interleaved_summary(rk["runs"]) for rk in res["ranks"]]
        print(res["table"], flush=True)
        res["complete"] = True
        C.write_json(args.json, res)
    return res


if __name__ == "__main__":
    main()
