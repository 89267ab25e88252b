"""Restore throughput: checkpointd.restore_latest() into live tensors beside raw reads and torch.load.

State: the reference workload's parameters and AdamW moments (fp32) at about STATE_GB, live on the GPU
(on CPU in CPU mode). For each target directory (default: a tmpfs and a disk directory) the same state
is first written (untimed) as raw files, a torch.save file and checkpointd checkpoints; then, with the
page cache of those files dropped before every timed read (posix_fadvise DONTNEED; a no-op on tmpfs)
and the live tensors zeroed:

- raw: the files read back with os.preadv (64 MiB chunks) from several threads into preallocated
  pinned host buffers; every thread count of --raw-threads; the best is the ceiling "raw";
- raw+h2d: the best raw read followed by copies into the live GPU tensors (a naive two-pass restore);
- raw_cold: the raw read as a resumed job's first read, the baseline of ``checkpointd_cold``: right
  after the raw files are written (before the rows above read them), each repetition a fresh Python
  process reads them with the most threads of --raw-threads into pageable buffers it touched first;
- torch_load: torch.load(weights_only=True) to CPU, then model.load_state_dict + optimizer.load_state_dict
  (which copy into / onto the live device);
- checkpointd / checkpointd_zstd / checkpointd_planes: restore_latest() of a fresh manager on that root,
  into the live objects (construction untimed, reported), of an uncompressed / ``"zstd"`` /
  ``"zstd-planes"`` checkpoint; into CUDA tensors a planes file is decoded on the GPU
  (``checkpointd.codecs.planes_device``), and ``checkpointd_planes_hostverify`` decodes it on the host;
- checkpointd_cold: the uncompressed restore as a resumed job does it, its only one: each repetition a
  fresh Python process builds the same model and optimizer (values zeroed; untimed), builds a manager
  (reported) and runs restore_latest() (timed inside that process); its values are checked by the
  parent. It pays what the rows above amortise: the process's first page-locking and first use of
  each thread pool, and the first read of files another process wrote;
  both fresh-process rows note how many pages the host moved to its active list during each read
  (``pgactivate`` in ``/proc/vmstat``): the kernel activates a written page on its next access under a
  shared lock, and a read that does so pays for every page (H200, 4.83 GB: the raw read's first read
  activated 1.18M pages and took 43 ms longer; checkpointd's mapped reads activated none); the table gives ``checkpointd_cold`` against ``raw_cold``, first to first and best to best;
- checkpointd_phases: the uncompressed restore taken apart, to show where its time goes against the
  floor of a verify-first restore (every byte checked before any reaches a live tensor): "verified read"
  (``checkpointd.restore.step.read_step``: map or read each file, checksum it, parse it), "apply"
  (``checkpointd.restore.apply.apply_entries``: the copies into the live tensors) and their sum
  per repetition; on CUDA also "h2d from pinned", the same bytes copied into the live tensors from
  page-locked host copies (the DMA alone, the copy's floor);
- checkpointd_hostverify / checkpointd_deviceverify: the uncompressed restore with every file
  checksummed on the host (CHECKPOINTD_RESTORE_VERIFY=host) / with the library's default said explicitly
  (=device: mapped files uploaded and checksummed on the GPU, ``checkpointd.restore.device_image``), to
  compare the two in one run; checkpointd_cold_hostverify and checkpointd_cold_deviceverify: the same as
  fresh processes (``checkpointd_cold``);
- checkpointd_cold_python: ``checkpointd_cold`` without the package's native code (CHECKPOINTD_NATIVE=0
  in the fresh process: the pure Python / NumPy paths), what a host without a C compiler gets;
- checkpointd_cold_planes: ``checkpointd_cold`` of a ``compression="zstd-planes"`` checkpoint, decoded on the
  GPU in a resumed job's only restore (where the kernel cache is empty, the first repetition also
  compiles the decoder's kernels; an earlier ``checkpointd_planes`` row of the run fills it).

A timed restore that follows a manager's ``close()`` (each repetition of the ``checkpointd`` rows, the
first of the phases) starts --settle-s (default 3 s on CUDA) after it: each restore_latest() prepares
the staging arena for the saves that would follow (the state's size, page-locked in the background),
and close() unpins and frees it; a restore begun right after that ran 20-100 ms slower (H200, 4.83 GB,
five restores each: median 288 ms with 0.5 s between, 205 with 3 s, 190 with no arena made at all).
A resumed job's restore follows no such teardown, so the rows wait it out
rather than time it.

Values are checked against checksums taken before saving ("ok" column). GB/s = state bytes / best time.
Target: restore_latest >= 0.7x raw.

Run:  python benchmarks/bench_restore.py [--state-gb 5] [--dirs /dev/shm/x,/var/tmp/x] [--json out.json]
      python benchmarks/bench_restore.py --cpu --tiny
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import traceback
import zlib
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

ALL_METHODS = ["raw", "raw_cold", "torch_load", "checkpointd", "checkpointd_zstd", "checkpointd_planes",
               "checkpointd_planes_hostverify", "checkpointd_cold", "checkpointd_phases",
               "checkpointd_deviceverify", "checkpointd_hostverify", "checkpointd_cold_deviceverify", "checkpointd_cold_hostverify",
               "checkpointd_cold_python", "checkpointd_cold_planes"]
SWITCH_METHODS = {"checkpointd_deviceverify": {"CHECKPOINTD_RESTORE_VERIFY": "device"},
                  "checkpointd_hostverify": {"CHECKPOINTD_RESTORE_VERIFY": "host"},
                  "checkpointd_planes_hostverify": {"CHECKPOINTD_RESTORE_VERIFY": "host"},
                  "checkpointd_cold_deviceverify": {"CHECKPOINTD_RESTORE_VERIFY": "device"},
                  "checkpointd_cold_hostverify": {"CHECKPOINTD_RESTORE_VERIFY": "host"},
                  "checkpointd_cold_python": {"CHECKPOINTD_NATIVE": "0"}}
"""Extra checkpointd rows: the same restore with a library switch set (``checkpointd.options``);
``checkpointd`` itself runs with the defaults."""
DEFAULT_METHODS = ["raw", "raw_cold", "torch_load", "checkpointd", "checkpointd_hostverify", "checkpointd_zstd",
                   "checkpointd_planes", "checkpointd_planes_hostverify", "checkpointd_cold", "checkpointd_cold_planes",
                   "checkpointd_cold_hostverify", "checkpointd_phases"]


def zero_live(ts: list[torch.Tensor], dev: C.Dev) -> None:
    with torch.no_grad():
        for t in ts:
            t.zero_()
    dev.sync()


def check(model, opt, ref: list[float]) -> bool:
    got = C.sample_checksums(C.state_tensors(model, opt))
    return len(got) == len(ref) and all(a == b for a, b in zip(got, ref))


def reset_live(model, opt, pristine: list[torch.Tensor], dev: C.Dev) -> None:
    """Put the saved values back into the live tensors (a failed method may have left them zeroed)."""
    with torch.no_grad():
        for t, p in zip(C.state_tensors(model, opt), pristine):
            t.copy_(p, non_blocking=True)
    dev.sync()


def settle(args) -> None:
    """Wait ``--settle-s`` before a repetition that follows a manager's ``close()`` (see the docstring)."""
    if args.settle_s > 0:
        time.sleep(args.settle_s)


def timed_restore(args, dev: C.Dev, root: str, model, opt, fn) -> list[float]:
    """Run ``fn`` --repeat times with the live tensors zeroed and the page cache dropped first."""
    times = []
    for _ in range(args.repeat):
        zero_live(C.state_tensors(model, opt), dev)
        C.drop_file_cache(root)
        C.collect()
        dev.sync()
        t0 = time.perf_counter()
        fn()
        dev.sync()
        times.append(time.perf_counter() - t0)
    return times


def bench_dir(out: dict, root: str, args, dev: C.Dev, model, opt, pristine: list[torch.Tensor], ref: list[float],
              state_bytes: int, flush) -> None:
    """One target: for each method write its files (untimed), time the restores, delete the files.

    Rows are appended to ``out["rows"]`` and ``flush()`` runs after each.
    """
    C.clean_dir(root)
    out["fs"] = C.fs_type(root)
    need = int(state_bytes * 1.15)
    if C.free_bytes(root) < need:
        out["skipped"] = f"needs {need / 1e9:.1f} GB free, has {C.free_bytes(root) / 1e9:.1f} GB"
        return
    rows = out["rows"]

    def add(row: dict) -> None:
        rows.append(row)
        flush()
    if "raw" in args.methods or "raw_cold" in args.methods:
        reset_live(model, opt, pristine, dev)
        d = os.path.join(root, "raw")
        _, files = C.raw_write(d, C.byte_views(pristine), nfiles=max(C.thread_counts(args.raw_threads)),
                               threads=os.cpu_count() or 1)
        if "raw_cold" in args.methods:  # first: its first repetition is the files' first read
            add(bench_raw_cold(root, args, files, C.byte_views(pristine)))
        if "raw" in args.methods:
            bench_raw(args, dev, root, files, model, opt, pristine, ref, add)
        shutil.rmtree(d, ignore_errors=True)
        C.collect()
    if "torch_load" in args.methods:
        reset_live(model, opt, pristine, dev)
        p = os.path.join(root, "torch_save.pt")
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, p)

        def torch_load():
            sd = torch.load(p, map_location="cpu", weights_only=True)
            model.load_state_dict(sd["model"])
            opt.load_state_dict(sd["optim"])  # replaces the optimizer's state tensors (cast to the param device)
        add({"method": "torch_load + load_state_dict", "kind": "torch_load",
                     "times_s": timed_restore(args, dev, root, model, opt, torch_load), "ok": check(model, opt, ref)})
        os.remove(p)
        C.collect()
    for m in [m for m in args.methods if m.startswith("checkpointd")]:
        if m == "checkpointd_phases":
            for row in bench_phases(root, args, dev, model, opt, pristine, ref):
                add(row)
        elif m.startswith("checkpointd_cold"):
            add(bench_cold(root, m, args, dev, model, opt, pristine, ref))
        else:
            add(bench_ckd(root, m, args, dev, model, opt, pristine, ref))
    shutil.rmtree(root, ignore_errors=True)


def bench_raw(args, dev: C.Dev, root: str, files: list[tuple[str, list[int]]], model, opt, pristine, ref, add) -> None:
    """``raw``: the raw files read into pinned host buffers at each thread count, then the best read + h2d."""
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=dev.cuda) for t in pristine]
    views = C.byte_views(host)
    host_ref = C.sample_checksums(pristine)  # summed on the CPU, as the host buffers are (``ref`` on the device)
    best = None
    for thr in C.thread_counts(args.raw_threads):
        times = []
        for _ in range(args.repeat):
            for h in host:
                h.zero_()
            C.drop_file_cache(root)
            times.append(C.raw_read(files, views, threads=thr))
        add({"method": f"raw read x {thr} thr", "kind": "raw", "times_s": times,
             "ok": C.sample_checksums(host) == host_ref})
        if best is None or min(times) < best[0]:
            best = (min(times), thr)
    if dev.cuda:  # the best raw read, then copies into the live GPU tensors (two passes)
        def raw_h2d():
            C.raw_read(files, views, threads=best[1])
            with torch.no_grad():
                for h, t in zip(host, C.state_tensors(model, opt)):
                    t.copy_(h, non_blocking=True)
        add({"method": f"raw read x {best[1]} thr + h2d", "kind": "raw+h2d",
             "times_s": timed_restore(args, dev, root, model, opt, raw_h2d), "ok": check(model, opt, ref)})


def fresh_process(flags: list[str], cpu: bool = False) -> dict:
    """Run this script with ``flags`` in a new Python process; its last stdout line, parsed as JSON."""
    cmd = [sys.executable, os.path.abspath(__file__), *flags] + (["--cpu"] if cpu else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"the fresh process failed ({proc.returncode}): {proc.stderr.strip()[-400:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def file_crcs(files: list[tuple[str, list[int]]], views: list[memoryview]) -> list[int]:
    """CRC-32 of each raw file as written: its views' bytes in order (zlib's: the baseline needs no checkpointd)."""
    out = []
    for _, group in files:
        crc = 0
        for i in group:
            crc = zlib.crc32(views[i], crc)
        out.append(crc)
    return out


def bench_raw_cold(root: str, args, files: list[tuple[str, list[int]]], views: list[memoryview]) -> dict:
    """``raw_cold``: the raw files read in a fresh process per repetition (see the docstring)."""
    threads = max(C.thread_counts(args.raw_threads))
    row: dict[str, Any] = {"method": f"raw read x {threads} thr, fresh process", "kind": "raw_cold",
                           "times_s": [], "notes": [], "activated": []}
    try:
        want = file_crcs(files, views)
        oks = []
        for _ in range(args.repeat):
            C.drop_file_cache(root)
            got = fresh_process(["--raw-cold-child", json.dumps([p for p, _ in files]), "--raw-threads", str(threads)])
            row["times_s"].append(got["read_s"])
            row["activated"].append(got["activated"])
            oks.append(got["crcs"] == want)
        row["ok"] = all(oks)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        row["error"] = C.error_text(e)
    return row


def raw_cold_child(args) -> None:
    """The fresh process of ``raw_cold``: touch a buffer per file, time reading the files into them, print JSON."""
    paths = json.loads(args.raw_cold_child)
    bufs = [torch.zeros(os.path.getsize(p), dtype=torch.uint8) for p in paths]  # pages touched before the clock
    views = C.byte_views(bufs)
    before = C.vmstat("pgactivate")
    seconds = C.raw_read([(p, [i]) for i, p in enumerate(paths)], views, threads=int(args.raw_threads))
    after = C.vmstat("pgactivate")
    print(json.dumps({"read_s": seconds, "activated": None if before is None or after is None else after - before,
                      "crcs": [zlib.crc32(v) for v in views]}), flush=True)


def bench_ckd(root: str, m: str, args, dev: C.Dev, model, opt, pristine, ref) -> dict:
    row: dict[str, Any] = {"method": m + " restore_latest", "kind": m, "times_s": [], "notes": []}
    ckd = C.try_import_checkpointd()
    if isinstance(ckd, str):
        row["error"] = ckd
        return row
    compression = "zstd-planes" if "_planes" in m else "zstd" if m.endswith("zstd") else None
    knobs = SWITCH_METHODS.get(m, {})
    if knobs:
        row["notes"].append(" ".join(f"{k}={v}" for k, v in knobs.items()))
    if compression and not C.has_zstd():
        row["skipped"] = "zstandard is not installed"
        return row
    d = os.path.join(root, m)
    kw = dict(keep_last=None, compression=compression)
    kw.update(C.parse_json_arg(args.ckd_kwargs))
    try:
        reset_live(model, opt, pristine, dev)
        with C.make_manager(d, {"model": model, "optim": opt}, notes=row["notes"], **kw) as mgr:
            mgr.maybe_save(1, force=True)
            mgr.wait()
        row["disk_bytes"] = C.dir_bytes(d)
        for _ in range(args.repeat):
            settle(args)  # after the last manager's close (the save's, the previous repetition's)
            zero_live(C.state_tensors(model, opt), dev)
            C.drop_file_cache(root)
            C.collect()
            t0 = time.perf_counter()
            mgr = C.make_manager(d, {"model": model, "optim": opt}, **kw)
            row.setdefault("setup_s", []).append(time.perf_counter() - t0)
            try:
                with C.env_set(knobs):
                    dev.sync()
                    t0 = time.perf_counter()
                    step = mgr.restore_latest()
                    dev.sync()
                row["times_s"].append(time.perf_counter() - t0)
                if step != 1:
                    row["notes"].append(f"restore_latest() returned {step!r}, expected 1")
                row["stats"] = C.safe_stats(mgr)
            finally:
                mgr.close()
        row["ok"] = check(model, opt, ref)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        row["error"] = C.error_text(e)
    shutil.rmtree(d, ignore_errors=True)
    C.collect()
    return row


def save_once(d: str, dev: C.Dev, model, opt, pristine, compression: str | None = None) -> None:
    """One checkpoint of the saved values (uncompressed unless ``compression``), step 1, into ``d`` (untimed)."""
    reset_live(model, opt, pristine, dev)
    with C.make_manager(d, {"model": model, "optim": opt}, keep_last=None, compression=compression) as mgr:
        mgr.maybe_save(1, force=True)
        mgr.wait()


def bench_cold(root: str, m: str, args, dev: C.Dev, model, opt, pristine, ref) -> dict:
    """``checkpointd_cold`` (and its ``_deviceverify`` / ``_hostverify`` / ``_python`` / ``_planes`` variants):
    each repetition's restore_latest() in a fresh process (see the docstring)."""
    knobs = SWITCH_METHODS.get(m, {})
    row: dict[str, Any] = {"method": f"{m.replace('_cold', '')} restore_latest, fresh process", "kind": m,
                           "times_s": [], "notes": [" ".join(f"{k}={v}" for k, v in knobs.items())] if knobs else [],
                           "activated": []}
    d = os.path.join(root, "checkpointd_cold")
    try:
        save_once(d, dev, model, opt, pristine, "zstd-planes" if m == "checkpointd_cold_planes" else None)
        width, depth = args.built_shape  # the child builds the same model
        oks = []
        for _ in range(args.repeat):
            C.drop_file_cache(root)
            with C.env_set(knobs):  # the child inherits them
                got = fresh_process(["--cold-child", d, "--D", str(width), "--L", str(depth)], cpu=not dev.cuda)
            row["times_s"].append(got["restore_s"])
            row["activated"].append(got["activated"])
            row.setdefault("setup_s", []).append(got["init_s"])
            oks.append(got["step"] == 1 and got["sums"] == ref)
        row["ok"] = all(oks)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        row["error"] = C.error_text(e)
    shutil.rmtree(d, ignore_errors=True)
    return row


def cold_child(args) -> None:
    """The fresh process of ``checkpointd_cold``: build the state, zero it, time one restore, print JSON."""
    dev = C.Dev(cpu=args.cpu)
    model, opt, _ = C.build_train_state(None, args.D, args.L, dev, on="device")
    zero_live(C.state_tensors(model, opt), dev)
    C.collect()
    t0 = time.perf_counter()
    mgr = C.make_manager(args.cold_child, {"model": model, "optim": opt}, keep_last=None, compression=None)
    t1 = time.perf_counter()
    try:
        dev.sync()
        before = C.vmstat("pgactivate")
        t2 = time.perf_counter()
        step = mgr.restore_latest()
        dev.sync()
        t3 = time.perf_counter()
        after = C.vmstat("pgactivate")
    finally:
        mgr.close()
    print(json.dumps({"restore_s": t3 - t2, "init_s": t1 - t0, "step": step,
                      "activated": None if before is None or after is None else after - before,
                      "sums": C.sample_checksums(C.state_tensors(model, opt))}), flush=True)


def bench_phases(root: str, args, dev: C.Dev, model, opt, pristine, ref) -> list[dict]:
    """``checkpointd_phases``: an uncompressed restore's verified read and apply, timed apart (see the docstring)."""
    names = ["checkpointd phases: verified read", "checkpointd phases: apply", "checkpointd phases: read + apply"]
    rows: list[dict[str, Any]] = [{"method": n, "kind": "phase", "times_s": [], "notes": []} for n in names]
    ckd = C.try_import_checkpointd()
    if isinstance(ckd, str):
        rows[0]["error"] = ckd
        return rows[:1]
    from checkpointd import commit  # noqa: PLC0415
    from checkpointd.format import layout  # noqa: PLC0415
    from checkpointd.restore import apply as restore_apply  # noqa: PLC0415
    from checkpointd.restore import device_image  # noqa: PLC0415
    from checkpointd.restore import step as restore  # noqa: PLC0415
    from checkpointd.restore.per_entry import check_compatible  # noqa: PLC0415

    def verifying(entries):
        return device_image.verifying_on(device_image.target_device([e.obj for e in entries]))
    d = os.path.join(root, "checkpointd_phases")
    try:
        save_once(d, dev, model, opt, pristine)
        with C.make_manager(d, {"model": model, "optim": opt}, keep_last=None, compression=None) as mgr:
            store, entries = mgr._store, mgr._entries  # noqa: SLF001 - the manager's own store and registered state
            step_dir = layout.step_dir_name(1)
            settle(args)  # after save_once's close (this manager, kept open, prepares no arena: no restore_latest)
            for _ in range(args.repeat):
                zero_live(C.state_tensors(model, opt), dev)
                C.drop_file_cache(root)
                C.collect()
                with verifying(entries):  # as restore_latest (on the GPU with CHECKPOINTD_RESTORE_VERIFY=device)
                    t0 = time.perf_counter()
                    manifest = commit.read_committed_manifest(store, step_dir)
                    contents = restore.read_step(store, step_dir, manifest)
                    dev.sync()
                    t1 = time.perf_counter()
                    values = restore.values_by_entry(manifest, contents)
                    check_compatible(entries, values, manifest.step)
                    dev.sync()
                    t2 = time.perf_counter()
                    restore_apply.apply_entries(entries, values)
                    dev.sync()
                    t3 = time.perf_counter()
                for row, secs in zip(rows, (t1 - t0, t3 - t2, (t1 - t0) + (t3 - t2))):
                    row["times_s"].append(secs)
                del contents, values
        ok = check(model, opt, ref)
        for row in rows:
            row["ok"] = ok
        if dev.cuda:
            host = pristine  # page-locked copies of the same values

            def h2d():
                with torch.no_grad():
                    for h, t in zip(host, C.state_tensors(model, opt)):
                        t.copy_(h, non_blocking=True)
            rows.append({"method": "h2d from pinned (the copy's floor)", "kind": "phase",
                         "times_s": timed_restore(args, dev, root, model, opt, h2d), "ok": check(model, opt, ref)})
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        rows[0]["error"] = C.error_text(e)
        rows = rows[:1]
    shutil.rmtree(d, ignore_errors=True)
    C.collect()
    return rows


def summarise(res: dict) -> str:
    i, w = res["info"], res["state"]
    lines = [f"\n== restore: {i['device']}, torch {i['torch']}, {i['date']}, {i['cpu_count']} cores, CRC-32 by {i.get('crc32', '?')}",
             f"   state {w['state_bytes'] / 1e9:.3f} GB in {w['tensors']} tensors (D={w['D']} L={w['L']}), live on {w['state_on']}",
             "   GB/s = state bytes / best of --repeat, page cache dropped before each read; x raw = vs the best raw read of "
             "the same dir; x raw median = the same row's median against that raw row's median (the first repetition "
             "included: for a manager it pays the process's first restore); ok = values equal the saved ones; "
             "target: checkpointd >= 0.7x raw",
             f"   each manager-based repetition starts {res['args'].get('settle_s', 0) or 0:g} s after the previous manager's close "
             "(its staging arena unpinned and freed; see the docstring)"]
    for d in res["dirs"]:
        lines.append(f"\n-- {d['dir']} ({d.get('fs')})")
        if d.get("skipped"):
            lines.append("   skipped: " + d["skipped"])
            continue
        rows = d["rows"]
        raw_best_row = max((r for r in rows if r["kind"] == "raw" and r.get("GBps")), key=lambda r: r["GBps"], default=None)
        raw_best = raw_best_row["GBps"] if raw_best_row else None
        raw_median = statistics.median(raw_best_row["times_s"]) if raw_best_row else None
        raw_cold = next((r for r in rows if r["kind"] == "raw_cold" and r.get("GBps")), None)
        trows = []
        for r in rows:
            t = {"method": r["method"]}
            if r.get("GBps"):
                median = statistics.median(r["times_s"])
                t.update(gbps=C.fmt(r["GBps"], ".2f"), best=C.fmt(min(r["times_s"]), ".3f"), median=C.fmt(median, ".3f"),
                         first=C.fmt(r["times_s"][0], ".3f"))
                if raw_best:
                    t["xraw"] = C.fmt(r["GBps"] / raw_best, ".2f")
                if raw_median:
                    t["xraw_median"] = C.fmt(raw_median / median, ".2f")
                if r["kind"].startswith("checkpointd") and raw_best:
                    t["target"] = "ok" if r["GBps"] >= 0.7 * raw_best else "MISS"
                if r.get("setup_s"):
                    t["setup"] = C.fmt(min(r["setup_s"]), ".2f")
            if "ok" in r:
                t["ok"] = "yes" if r["ok"] else "NO"
            note = "; ".join(([("ERROR " + r["error"])] if r.get("error") else [])
                             + ([("skipped: " + r["skipped"])] if r.get("skipped") else []) + r.get("notes", [])
                             + cold_notes(r, raw_cold))
            if note:
                t["note"] = note[:110]
            trows.append(t)
        cols = [("method", "method"), ("gbps", "GB/s"), ("best", "best s"), ("median", "median s"), ("first", "first s"),
                ("xraw", "x raw"), ("target", ">=0.7x raw"), ("xraw_median", "x raw median"), ("ok", "ok"), ("setup", "mgr init s"), ("note", "note")]
        lines.append(C.table(trows, [c for c in cols if any(c[0] in r for r in trows)]))
    return "\n".join(lines)


def cold_notes(r: dict, raw_cold: dict | None) -> list[str]:
    """A fresh-process row's pages activated per read and, for checkpointd's, its ratio to ``raw_cold``."""
    out = []
    if r["kind"].startswith("checkpointd_cold") and raw_cold and r.get("times_s"):
        first = raw_cold["times_s"][0] / r["times_s"][0]
        best = min(raw_cold["times_s"]) / min(r["times_s"])
        out.append(f"x raw fresh process: first {first:.2f}, best {best:.2f}")
    acts = r.get("activated") or []
    if acts and all(a is not None for a in acts):
        out.append("pages activated " + "/".join(f"{a / 1e6:.2f}M" if a >= 1e6 else f"{a / 1e3:.1f}k" for a in acts))
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--tiny", action="store_true", help="about 20 MB of state (smoke test)")
    p.add_argument("--state-gb", type=float, default=C.env_float("STATE_GB", 5.0))
    p.add_argument("--D", type=int, default=None)
    p.add_argument("--L", type=int, default=None)
    p.add_argument("--dirs", default=C.env_str("RESTORE_DIRS", C.env_str("PERSIST_DIRS", "/dev/shm/ckd-restore,/var/tmp/ckd-restore")),
                   help="comma list of target directories (each is created and removed)")
    p.add_argument("--methods", default=C.env_str("RESTORE_METHODS", ",".join(DEFAULT_METHODS)),
                   help="comma list from " + ", ".join(ALL_METHODS) + " (default: " + ",".join(DEFAULT_METHODS) + ")")
    p.add_argument("--raw-threads", default=C.env_str("RAW_THREADS", "1,8,max"))
    p.add_argument("--repeat", type=int, default=C.env_int("REPEAT", 2))
    p.add_argument("--settle-s", type=float, default=C.env_float("SETTLE_S", None),
                   help="pause before each manager-based repetition (default 3 on CUDA, 0 on CPU; see the docstring)")
    p.add_argument("--ckd-kwargs", default=C.env_str("CKD_KWARGS", None), help="JSON object of extra CheckpointManager kwargs")
    C.add_prefault_arg(p)
    p.add_argument("--json", default=None)
    p.add_argument("--cold-child", default=None, help=argparse.SUPPRESS)  # checkpointd_cold's fresh process
    p.add_argument("--raw-cold-child", default=None, help=argparse.SUPPRESS)  # raw_cold's: a JSON list of files
    a = p.parse_args(argv)
    if a.tiny:
        a.D, a.L = a.D or 256, a.L or 2
    a.methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    for m in a.methods:
        if m not in ALL_METHODS:
            p.error(f"unknown method {m!r}")
    if a.settle_s is None:
        a.settle_s = 0.0 if a.cpu or not torch.cuda.is_available() else 3.0
    return a


def main(argv=None):
    args = parse_args(argv)
    if args.cold_child:
        return cold_child(args)
    if args.raw_cold_child:
        return raw_cold_child(args)
    dev = C.Dev(cpu=args.cpu)
    info = C.env_info(dev)
    info["prefault"] = C.prefault_host_memory(args.prefault_gb, dev)
    print(f"[restore] {info['device']}  torch {info['torch']}  checkpointd {info['checkpointd']}", flush=True)
    model, opt, st = C.build_train_state(args.state_gb, args.D, args.L, dev, on="device")
    args.built_shape = (st["D"], st["L"])
    live = C.state_tensors(model, opt)
    ref = C.sample_checksums(live)
    # the saved values (pinned host copies), to reset the live state between methods
    pristine = [torch.empty(t.shape, dtype=t.dtype, pin_memory=dev.cuda).copy_(t) for t in live]
    print(f"[restore] state {st['state_bytes'] / 1e9:.3f} GB in {st['tensors']} tensors on {st['state_on']}", flush=True)
    res = {"info": info, "state": st, "args": vars(args), "dirs": []}
    res["complete"] = False

    def flush():
        for dd in res["dirs"]:
            for r in dd["rows"]:
                if r.get("times_s") and not r.get("error") and "GBps" not in r:
                    r["GBps"] = st["state_bytes"] / min(r["times_s"]) / 1e9
                    print(f"[restore] {dd['dir']}: {r['method']}: {r['GBps']:.2f} GB/s", flush=True)
                elif r.get("error") and not r.get("_printed"):
                    r["_printed"] = True
                    print(f"[restore] {dd['dir']}: {r['method']}: {r['error']}", flush=True)
        C.write_json(args.json, res, quiet=True)

    for root in [d.strip() for d in args.dirs.split(",") if d.strip()]:
        d = {"dir": root, "fs": None, "rows": []}
        res["dirs"].append(d)
        try:
            bench_dir(d, root, args, dev, model, opt, pristine, ref, st["state_bytes"], flush)
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
