"""Persist throughput: checkpointd's full save beside raw writes and torch.save, same bytes, same run.

State: the reference workload's parameters and AdamW moments (fp32, hundreds of tensors of realistic
sizes, up to 4D x D) at about STATE_GB, as CPU tensors (pinned when CUDA is present) or, with
``--state-on device``, on the GPU. For each target directory (default: a tmpfs and a disk directory):

- raw: the same tensor bytes written with os.pwrite (64 MiB chunks) from several threads into one file
  and into several files, fsync'd; every thread count of --raw-threads; on disks also with each chunk
  handed to the disk once written (``sync_file_range``, "writeback"); the best is the ceiling "raw";
- torch_save: torch.save({"model": ..., "optim": ...}) of the same state, then fsync of the file;
- checkpointd / checkpointd_threads / checkpointd_zstd / checkpointd_planes: time from maybe_save(step, force=True) until
  wait() returns (the checkpoint is committed and durable); the targets apply to this. Each manager's
  first save is a warm-up timed apart ("warm-up s"): it pins the staging arena, which a training run
  allocates ahead of its first save. The default writes the tensor records from the persist process
  (checkpointd.storage.persist_process). checkpointd_threads: CHECKPOINTD_PERSIST_PROCESS=0, the records
  written by threads of this process. See bench_stall.py for what each costs the training steps. For
  diagnosis, also the time until wait_for_snapshot() returns ("snapshot ms") and the throughput from
  then to wait() ("GB/s after snapshot": the persist alone, if the writer does not overlap the snapshot);
- checkpointd_device / checkpointd_device_planes (``--state-on device``): the same with device staging;
  the ``_fast`` rows write every save as a preemption save is (``writemode.FAST_PERSIST``): with
  ``zstd-planes`` the float tensors are then encoded on the GPU (checkpointd.save.device_encode), so
  the pair shows what compression costs a preemption save's time to commit there;
- checkpointd_recycle: the steady state of training (keep_last=1), each save written over the files
  that retention retired (checkpointd.storage.recycle).

Every repetition's files are deleted after it, outside the timed region, and the next repetition
starts --settle-s (default 1 s) later: a raw row's deletion frees the files' pages at once (tmpfs), but
the persist process lets go of a deleted checkpoint file's mapping, and so of its pages, only within
0.5 s (``persist_process_main.PRUNE_INTERVAL_S``), which without the pause falls inside the next timed
save (on an H200 host: 0.66-0.86 s with it, 0.82-0.98 without). The same pause follows a row's warm-up
save.

Each row is repeated --repeat times in each of --rounds rounds; rounds interleave the rows (round 1 of
every row, then round 2, ...), so drift of the target during the run (this matters on disks) falls on
every row alike. "GB/s" is state bytes / best time; "first" is the first repetition; "x raw/round" is
the median over rounds of the row's best time in the round against the best raw row's in the same round.
Targets: checkpointd >= 0.9x raw and >= 3x torch.save.

Run:  python benchmarks/bench_persist.py [--state-gb 5] [--dirs /dev/shm/x,/var/tmp/x] [--json out.json]
      python benchmarks/bench_persist.py --cpu --tiny
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
import traceback
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

ALL_METHODS = ["raw", "torch_save", "checkpointd", "checkpointd_recycle", "checkpointd_threads", "checkpointd_zstd",
               "checkpointd_planes", "checkpointd_device", "checkpointd_device_planes", "checkpointd_device_fast",
               "checkpointd_device_planes_fast"]
"""Rows named ``..._device...`` stage on the device (``StagingOptions(device_budget_bytes=...)``; a state on
the GPU); ``..._fast`` ones write every save as a preemption save is (``writemode.FAST_PERSIST``), which
with ``zstd-planes`` encodes the floats on the GPU (``checkpointd.save.device_encode``)."""
RECYCLING = "checkpointd_recycle"
"""The steady state of training (``keep_last=1``): each save writes over the files that retention retired
(``checkpointd.storage.recycle``); compared with the raw rows that write over existing files (kind ``raw_overwrite``)."""
METHOD_ENV = {"checkpointd_threads": {"CHECKPOINTD_PERSIST_PROCESS": "0"}}
"""Extra checkpointd rows: the same save with a library switch set (``checkpointd.options``)."""
NEW_FILES_ENV = {"CHECKPOINTD_RECYCLE": "0"}
"""Every row but checkpointd_recycle times saves into new files, as a run that keeps every checkpoint makes
them: with recycling off the library neither reuses retired files nor makes blank files ahead for a run's
first saves (``filesahead.FilesAhead``), which some repetitions would take and others run beside (on an H200
host a blank file's save writes in 0.31-0.41 s after its snapshot, a new file's in 0.62-1.22 s). The
recycling row keeps them (a training run's first saves take them)."""


SETTLE_S = 1.0


def settle() -> None:
    """The pause after a repetition's files were deleted (``--settle-s``)."""
    if SETTLE_S > 0:
        time.sleep(SETTLE_S)


def host_mirror(ts: list[torch.Tensor], dev: C.Dev) -> list[torch.Tensor]:
    """Contiguous CPU tensors (pinned on CUDA) holding the bytes of ``ts``, for the raw writer."""
    out = []
    for t in ts:
        if t.device.type == "cpu" and t.is_contiguous():
            out.append(t.detach())
        else:
            h = torch.empty(t.shape, dtype=t.dtype, pin_memory=dev.cuda)
            h.copy_(t)
            out.append(h)
    dev.sync()
    return out


class Row:
    """One table row: ``once()`` times a single repetition; ``close()`` frees what the row holds.

    Rows are timed round by round (``--rounds``): every row's repetitions of round 1, then of round 2,
    and so on, so a target whose speed drifts during the run (a disk that slows as it fills its
    cache, a host that warms up) spreads the drift over all rows instead of charging the last ones.
    """

    def __init__(self, method: str, kind: str, once: Callable[[], float] | None = None) -> None:
        self.data: dict[str, Any] = {"method": method, "kind": kind, "times_s": [], "rounds": []}
        self._once = once

    def once(self) -> float:
        assert self._once is not None
        return self._once()

    def close(self) -> None:
        pass


def raw_row(root: str, views, method: str, overwrite: bool = False, **kw) -> Row:
    """Raw writes into new files, or (``overwrite``) over the files of the row's previous repetition
    (the first is written untimed), as checkpointd writes over recycled files."""
    d = os.path.join(root, "raw-overwrite" if overwrite else "raw")

    def once() -> float:
        if not overwrite:
            C.clean_dir(d)
        elif not os.path.isdir(d):
            C.raw_write(d, views, **kw)
        dt, _ = C.raw_write(d, views, truncate=not overwrite, **kw)
        if not overwrite:
            shutil.rmtree(d, ignore_errors=True)
            settle()
        return dt

    row = Row(method, "raw_overwrite" if overwrite else "raw", once)
    row.close = lambda: shutil.rmtree(d, ignore_errors=True)  # type: ignore[method-assign]
    return row


def torch_save_row(root: str, out: dict, model, opt) -> Row:
    def once() -> float:
        p = os.path.join(root, "torch_save.pt")
        C.collect()
        t0 = time.perf_counter()
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, p)
        C.fsync_path(p)
        dt = time.perf_counter() - t0
        out["torch_save_file_bytes"] = os.path.getsize(p)
        os.remove(p)
        return dt
    return Row("torch_save (+fsync)", "torch_save", once)


def rows_for(out: dict, root: str, args, dev: C.Dev, model, opt, views) -> list[Row]:
    """The rows of one directory, in table order."""
    rows: list[Row] = []
    if "raw" in args.methods:  # every (files, threads) variant; the best is the ceiling
        for thr in C.thread_counts(args.raw_threads):
            for nf in sorted({1, thr}):
                rows.append(raw_row(root, views, f"raw {nf} file{'s' if nf > 1 else ''} x {thr} thr", nfiles=nf, threads=thr))
            if thr > 1:  # the same into one mapped file (checkpointd's mode on tmpfs): scales where pwrite cannot
                rows.append(raw_row(root, views, f"raw 1 file x {thr} thr (mmap)", nfiles=1, threads=thr, mmap_mode=True))
            if thr > 1 and not C.is_memory_fs(out["fs"]):  # disks: each chunk handed to the disk once written
                for nf in sorted({1, thr}):
                    rows.append(raw_row(root, views, f"raw {nf} file{'s' if nf > 1 else ''} x {thr} thr (writeback)",
                                        nfiles=nf, threads=thr, writeback=True))
        # the checkpoint's own files (model, optimizer) side by side, one thread each: what a save of
        # this state can reach when each file is written at the speed one file allows
        n_model = sum(1 for _ in model.parameters())
        like = [list(range(n_model)), list(range(n_model, len(views)))]
        rows.append(raw_row(root, views, "raw model + optim files x 1 thr each", nfiles=2, threads=2, groups=like))
        if RECYCLING in args.methods:  # its ceiling: the fastest writes over existing files
            thr = max(C.thread_counts(args.raw_threads))
            memory = C.is_memory_fs(out["fs"])
            rows.append(raw_row(root, views, f"raw 1 file x {thr} thr ({'mmap' if memory else 'writeback'}, overwrite)",
                                overwrite=True, nfiles=1, threads=thr, mmap_mode=memory, writeback=not memory))
    if "torch_save" in args.methods:
        rows.append(torch_save_row(root, out, model, opt))
    for m in [m for m in args.methods if m.startswith("checkpointd")]:
        row = CheckpointdRow(root, m, args, dev, model, opt)
        need = 3.3 * sum(len(v) for v in views)  # kept step + retired files + the save being written
        if m == RECYCLING and C.free_bytes(root) < need and not row.data.get("skipped"):
            row.data["skipped"] = f"needs {need / 1e9:.1f} GB free for three copies of the state"
        rows.append(row)
    return rows


def bench_dir(out: dict, root: str, args, dev: C.Dev, model, opt, views, state_bytes: int, flush) -> None:
    """One target directory; rows are appended to ``out["rows"]`` and ``flush()`` runs after each."""
    C.clean_dir(root)
    out["fs"] = C.fs_type(root)
    free = C.free_bytes(root)
    need = int(state_bytes * (1.15 if not args.keep_files else 2.3))
    if free < need:
        out["skipped"] = f"needs {need / 1e9:.1f} GB free, has {free / 1e9:.1f} GB"
        return
    rows = rows_for(out, root, args, dev, model, opt, views)
    try:
        for rnd in range(args.rounds):
            for row in rows:
                if rnd == 0:
                    out["rows"].append(row.data)
                if row.data.get("error") or row.data.get("skipped"):
                    continue
                for _ in range(args.repeat):
                    try:
                        dt = row.once()
                    except Exception as e:  # noqa: BLE001 - one broken row must not end the table
                        traceback.print_exc()
                        row.data["error"] = C.error_text(e)
                        break
                    row.data["times_s"].append(dt)
                    row.data["rounds"].append(rnd)
                flush()
    finally:
        for row in rows:
            row.close()
    C.clean_dir(root)
    shutil.rmtree(root, ignore_errors=True)


class CheckpointdRow(Row):
    """checkpointd's save of the state by one manager, from maybe_save(force=True) until wait() returns.

    The manager lives across rounds (its staging arena is pinned once, as in training, where it is
    allocated ahead of the first save). Its first save is a warm-up, timed apart ("warm-up s": it
    pins the arena and starts the persist process); each repetition's step directory is removed
    outside the timed region.
    """

    def __init__(self, root: str, method: str, args, dev: C.Dev, model, opt) -> None:
        super().__init__(method, method)
        self.method = method
        self.data["notes"] = []
        self.dir = os.path.join(root, method)
        self.args, self.dev, self.model, self.opt = args, dev, model, opt
        self.knobs = dict(METHOD_ENV.get(method, {}))
        if method != RECYCLING:  # rows into new files: every save writes new files (see NEW_FILES_ENV)
            self.knobs.update(NEW_FILES_ENV)
        self.mgr: Any = None
        self.step = 0
        if self.knobs:
            self.data["notes"].append(" ".join(f"{k}={v}" for k, v in self.knobs.items()))
        ckd = C.try_import_checkpointd()
        parts = method.split("_")
        self.compression = "zstd" if "zstd" in parts else "zstd-planes" if "planes" in parts else None
        self.fast = "fast" in parts
        self.staging: dict = {}
        if isinstance(ckd, str):
            self.data["error"] = ckd
        elif self.compression and not C.has_zstd():
            self.data["skipped"] = "zstandard is not installed"
        elif "device" in parts:
            kw, why = C.device_staging_kwargs(None) if dev.cuda and args.state_on == "device" else (None, "")
            if kw is None:
                self.data["skipped"] = why or "device staging needs the state on a CUDA device (--state-on device)"
            else:
                self.staging = kw
                self.data["notes"].append(why)

    def once(self) -> float:
        row, d = self.data, self.dir
        with C.env_set(self.knobs):
            if self.mgr is None:
                C.clean_dir(d)
                kw = dict(keep_last=1 if self.method == RECYCLING else None, compression=self.compression, max_pending=1)
                kw.update(self.staging)
                kw.update(C.parse_json_arg(self.args.ckd_kwargs))
                t0 = time.perf_counter()
                self.mgr = C.make_manager(d, {"model": self.model, "optim": self.opt}, notes=row["notes"], **kw)
                row["setup_s"] = time.perf_counter() - t0
                row["warmup_s"] = self._save()[0]
                if self.method == RECYCLING:  # retention after this one retires the first: the bin holds a save
                    self._save()
                self._clear()
                settle()  # the warm-up's pages too
            dt = self._save()
        row.setdefault("snapshot_s", []).append(dt[1])
        row.setdefault("after_snapshot_s", []).append(dt[0] - dt[1])
        row.setdefault("block_s", []).append(dt[2])
        sd = [os.path.join(d, x) for x in os.listdir(d) if x.startswith("step-")]
        row["disk_bytes"] = sum(C.dir_bytes(x) for x in sd)
        row["stats"] = C.safe_stats(self.mgr)
        self._clear()
        settle()
        return dt[0]

    def _save(self) -> tuple[float, float, float]:
        """One save: (seconds until wait() returned, until the snapshot was taken, until maybe_save returned)."""
        from checkpointd.storage import writemode  # noqa: PLC0415 - the fast rows' switch
        was, writemode.FAST_PERSIST = writemode.FAST_PERSIST, self.fast
        try:
            return self._timed_save()
        finally:
            writemode.FAST_PERSIST = was

    def _timed_save(self) -> tuple[float, float, float]:
        with C.env_set(self.knobs):
            self.step += 1
            C.collect()
            self.dev.sync()
            t0 = time.perf_counter()
            started = self.mgr.maybe_save(self.step, force=True)
            tb = time.perf_counter()
            if hasattr(self.mgr, "wait_for_snapshot"):  # SPEC section 1: the snapshot copies are done
                self.mgr.wait_for_snapshot()
            ts = time.perf_counter()
            self.mgr.wait()
            t1 = time.perf_counter()
        if not started:
            self.data["notes"].append(f"maybe_save({self.step}, force=True) returned False")
        return t1 - t0, ts - t0, tb - t0

    def _clear(self) -> None:
        """Free the space outside the timed region (the manager keeps every step; with recycling,
        retention keeps one and retires the rest)."""
        if not self.args.keep_files and self.method != RECYCLING:
            for x in os.listdir(self.dir):
                if x.startswith("step-"):
                    shutil.rmtree(os.path.join(self.dir, x), ignore_errors=True)

    def close(self) -> None:
        if self.mgr is not None:
            try:
                self.mgr.close()
            except Exception as e:  # noqa: BLE001
                self.data["notes"].append("close: " + C.error_text(e))
            self.mgr = None
        shutil.rmtree(self.dir, ignore_errors=True)


def round_bests(rows: list[dict]) -> dict[int, float]:
    """Round -> the best (shortest) time of any of ``rows`` in that round."""
    best: dict[int, float] = {}
    for r in rows:
        if r.get("error"):
            continue
        for rnd, t in zip(r.get("rounds", []), r.get("times_s", [])):
            best[rnd] = min(best.get(rnd, t), t)
    return best


def per_round_ratio(row: dict, raw_by_round: dict[int, float]) -> float | None:
    """Median over rounds of (best raw time / the row's best time) within each round: drift-paired x raw."""
    mine = round_bests([row])
    ratios = sorted(raw_by_round[k] / mine[k] for k in mine if k in raw_by_round)
    return statistics.median(ratios) if ratios else None


def summarise(res: dict) -> str:
    i, w = res["info"], res["state"]
    lines = [f"\n== persist: {i['device']}, torch {i['torch']}, {i['date']}, {i['cpu_count']} cores, CRC-32 by {i.get('crc32', '?')}",
             f"   state {w['state_bytes'] / 1e9:.3f} GB in {w['tensors']} tensors (D={w['D']} L={w['L']}, fp32 params + AdamW moments), "
             f"on {w['state_on']}{' pinned' if w['pinned'] else ''}",
             f"   GB/s = state bytes / best of {res['args']['repeat']} x {res['args'].get('rounds', 1)} round(s) (first = first "
             "repetition); x raw = vs the best raw row of the same dir (overwrite rows and checkpointd_recycle: the best raw "
             "overwrite row); x raw/round = median over rounds of the same, "
             "round by round (rows interleave); targets: checkpointd >= 0.9x raw, >= 3x torch_save"]
    for d in res["dirs"]:
        lines.append(f"\n-- {d['dir']} ({d['fs']})")
        if d.get("skipped"):
            lines.append("   skipped: " + d["skipped"])
            continue
        rows = d["rows"]
        ts_best = next((r["GBps"] for r in rows if r["kind"] == "torch_save" and r.get("GBps")), None)
        trows = []
        for r in rows:
            # new files against raw writes of new files; overwrites (recycling) against raw overwrites
            family = "raw_overwrite" if r["kind"] in ("raw_overwrite", RECYCLING) else "raw"
            if not any(x["kind"] == family for x in rows):
                family = "raw"
            raw_best = max((x["GBps"] for x in rows if x["kind"] == family and x.get("GBps")), default=None)
            raw_by_round = round_bests([x for x in rows if x["kind"] == family])
            t = {"method": r["method"]}
            if r.get("GBps"):
                t.update(gbps=C.fmt(r["GBps"], ".2f"), best=C.fmt(min(r["times_s"]), ".3f"), first=C.fmt(r["times_s"][0], ".3f"))
                if raw_best:
                    t["xraw"] = C.fmt(r["GBps"] / raw_best, ".2f")
                paired = per_round_ratio(r, raw_by_round)
                if paired is not None and len(raw_by_round) > 1:
                    t["xround"] = C.fmt(paired, ".2f")
                if ts_best:
                    t["xts"] = C.fmt(r["GBps"] / ts_best, ".2f")
                if r["kind"].startswith("checkpointd"):
                    ok = []
                    if raw_best:
                        ok.append("ok" if r["GBps"] >= 0.9 * raw_best else "MISS")
                    if ts_best:
                        ok.append("ok" if r["GBps"] >= 3 * ts_best else "MISS")
                    t["target"] = "/".join(ok)
                    if r.get("warmup_s") is not None:
                        t["warm"] = C.fmt(r["warmup_s"], ".3f")
                    if r.get("block_s"):
                        t["block"] = C.fmt(1e3 * min(r["block_s"]), ".1f")
                    if r.get("snapshot_s"):
                        t["snap"] = C.fmt(1e3 * min(r["snapshot_s"]), ".1f")
                        t["after"] = C.fmt(res["state"]["state_bytes"] / min(r["after_snapshot_s"]) / 1e9, ".2f")
                    if r.get("disk_bytes"):
                        t["ratio"] = C.fmt(res["state"]["state_bytes"] / r["disk_bytes"], ".3f")
            note = "; ".join(([("ERROR " + r["error"])] if r.get("error") else [])
                             + ([("skipped: " + r["skipped"])] if r.get("skipped") else []) + r.get("notes", []))
            if note:
                t["note"] = note[:110]
            trows.append(t)
        cols = [("method", "method"), ("gbps", "GB/s"), ("best", "best s"), ("first", "first s"), ("warm", "warm-up s"), ("xraw", "x raw"), ("xround", "x raw/round"),
                ("xts", "x torch_save"), ("target", "0.9x raw/3x ts"), ("block", "block ms"), ("snap", "snapshot ms"),
                ("after", "GB/s after snapshot"), ("ratio", "size ratio"), ("note", "note")]
        lines.append(C.table(trows, [c for c in cols if any(c[0] in r for r in trows)]))
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--tiny", action="store_true", help="about 20 MB of state (smoke test)")
    p.add_argument("--state-gb", type=float, default=C.env_float("STATE_GB", 5.0))
    p.add_argument("--D", type=int, default=None)
    p.add_argument("--L", type=int, default=None)
    p.add_argument("--state-on", choices=["cpu", "device"], default="cpu",
                   help="cpu: pinned CPU tensors (default); device: the state lives on the GPU (save includes D2H)")
    p.add_argument("--dirs", default=C.env_str("PERSIST_DIRS", "/dev/shm/ckd-persist,/var/tmp/ckd-persist"),
                   help="comma list of target directories (each is created and removed)")
    p.add_argument("--methods", default=",".join(ALL_METHODS), help="comma list from " + ", ".join(ALL_METHODS))
    p.add_argument("--raw-threads", default=C.env_str("RAW_THREADS", "1,8,max"), help="thread counts for raw writes")
    p.add_argument("--repeat", type=int, default=C.env_int("REPEAT", 2), help="repetitions of a row in each round")
    p.add_argument("--rounds", type=int, default=C.env_int("ROUNDS", 1),
                   help="passes over all rows, interleaved (round 1 of every row, then round 2, ...): use 3 or more "
                        "on disks whose speed drifts during a run")
    p.add_argument("--settle-s", type=float, default=C.env_float("SETTLE_S", 1.0),
                   help="pause after each repetition's files are deleted (see the docstring)")
    p.add_argument("--keep-files", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ckd-kwargs", default=C.env_str("CKD_KWARGS", None), help="JSON object of extra CheckpointManager kwargs")
    C.add_prefault_arg(p)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.tiny:
        a.D, a.L = a.D or 256, a.L or 2
    a.methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    for m in a.methods:
        if m not in ALL_METHODS:
            p.error(f"unknown method {m!r}")
    return a


def main(argv=None):
    global SETTLE_S
    args = parse_args(argv)
    SETTLE_S = args.settle_s
    dev = C.Dev(cpu=args.cpu)
    info = C.env_info(dev)
    info["prefault"] = C.prefault_host_memory(args.prefault_gb, dev)
    print(f"[persist] {info['device']}  torch {info['torch']}  checkpointd {info['checkpointd']}", flush=True)
    t0 = time.perf_counter()
    model, opt, st = C.build_train_state(args.state_gb, args.D, args.L, dev, on=args.state_on)
    ts = C.state_tensors(model, opt)
    views = C.byte_views(host_mirror(ts, dev))
    print(f"[persist] state {st['state_bytes'] / 1e9:.3f} GB in {st['tensors']} tensors on {st['state_on']} "
          f"(built in {time.perf_counter() - t0:.1f} s)", flush=True)
    res = {"info": info, "state": st, "args": vars(args), "dirs": []}
    res["complete"] = False

    def flush():
        for dd in res["dirs"]:
            for r in dd["rows"]:
                if r.get("times_s") and not r.get("error") and r.get("_shown") != len(r["times_s"]):
                    r["_shown"] = len(r["times_s"])
                    r["GBps"] = st["state_bytes"] / min(r["times_s"]) / 1e9
                    last = st["state_bytes"] / r["times_s"][-1] / 1e9
                    print(f"[persist] {dd['dir']}: {r['method']}: round {r['rounds'][-1] + 1}: last {last:.2f} GB/s, "
                          f"best so far {r['GBps']:.2f}", flush=True)
                elif r.get("error") and not r.get("_printed"):
                    r["_printed"] = True
                    print(f"[persist] {dd['dir']}: {r['method']}: {r['error']}", flush=True)
        C.write_json(args.json, res, quiet=True)

    for root in [d.strip() for d in args.dirs.split(",") if d.strip()]:
        d = {"dir": root, "fs": None, "rows": []}
        res["dirs"].append(d)
        try:
            bench_dir(d, root, args, dev, model, opt, views, st["state_bytes"], flush)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            d["skipped"] = "ERROR " + C.error_text(e)
            shutil.rmtree(root, ignore_errors=True)
        flush()
    res["complete"] = True
    text = summarise(res)
    print(text, flush=True)
    res["table"] = text
    C.write_json(args.json, res)
    return res


if __name__ == "__main__":
    main()
