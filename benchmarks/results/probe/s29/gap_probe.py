"""Session 29 probe: where `restore_latest` spends the time beyond its two passes, on one GPU.

Session 28 measured each pass alone (checksum 50 ms, the bounce of one contiguous 4.83 GB file 90 ms,
H200) while `restore_latest` spent 200-290 ms: the verified read 73-85 and the bulk copy 109-125. This
probe takes one 4.83 GB checkpoint (bench_restore's state) in /dev/shm and, ROUNDS times, restores it
with a fresh manager (live tensors zeroed first, values checked after), timing inside the restore:

- read_step (verified read), per file read_file_verified, the parse beside the checksum (``meanwhile``),
  and per checksum task its page population (``MADV_POPULATE_READ``) and its CRC, summed over tasks;
- apply_entries, copy_pairs, _bounced_h2d, torch's Optimizer.load_state_dict, _prepare_pending_buffers.

Then, outside the timed restore, the manager closed (its staging arena, prepared after the restore,
released; ``PROBE_NO_ARENA=1``: never made) and after 0.5 s (``PROBE_SLEEP``), with the restore's own read buffers still mapped:

- ``again``: copy_pairs on the restore's own pairs, twice (the same bounce, warm);
- ``small``/``large``: the bounce of the pairs under / over 1 MiB alone;
- ``contig``: the bounce of each whole mapped file into one GPU buffer (session 28's 90 ms row);
- ``populate``/``crc``: a fresh mapping of each file populated by 16 threads in 32 MiB ranges, then
  checksummed on its populated pages (the verified read's two halves apart).

``PROBE_PROFILE=1``: the last round's restore_latest under cProfile (printed; its time is not comparable).

Run: python benchmarks/results/probe/s29/gap_probe.py [ROUNDS] [--json out.json]
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", ".."))
import common as C  # noqa: E402
import bench_restore as B  # noqa: E402
import torch  # noqa: E402

from checkpointd import bulkcopy, fastload, pagemem, ptlayout, restore, restore_apply  # noqa: E402
from checkpointd.crc import crc32  # noqa: E402
import checkpointd.manager as M  # noqa: E402

marks: dict[str, float] = {}
lock = threading.Lock()
captured: dict[str, list] = {"pairs": [], "bufs": []}


def add(name: str, secs: float) -> None:
    with lock:
        marks[name] = marks.get(name, 0.0) + secs


def timed(owner, name: str, label: str | None = None, capture=None):
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            out = fn(*a, **k)
            if capture is not None:
                capture(a, k, out)
            return out
        finally:
            add(label or name, time.perf_counter() - t0)
    setattr(owner, name, wrapper)


def crc_task(buf, view, start, stop):
    t0 = time.perf_counter()
    pagemem.populate_read(buf.data_ptr() + start, stop - start)
    t1 = time.perf_counter()
    c = crc32(view[start:stop], 0)
    t2 = time.perf_counter()
    add("task_populate", t1 - t0)
    add("task_crc", t2 - t1)
    return c


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 6
    out = sys.argv[sys.argv.index("--json") + 1] if "--json" in sys.argv else None
    dev = C.Dev(cpu=os.environ.get("PROBE_CPU") == "1")
    model, opt, st = C.build_train_state(float(os.environ.get("PROBE_GB", "5")), None, None, dev, on="device")
    ref = C.sample_checksums(C.state_tensors(model, opt))
    root = "/dev/shm/ckd-gapprobe"
    d = os.path.join(root, "ckpt")
    B.save_once(d, dev, model, opt, [t.clone() for t in C.state_tensors(model, opt)])
    print(st, "threads", torch.get_num_threads(), "io", ptlayout.io_threads(), flush=True)

    fastload._crc_task = crc_task
    timed(restore, "read_step")
    timed(fastload, "read_file_verified", capture=lambda a, k, o: captured["bufs"].append((a[0], o[0])))
    timed(restore_apply, "apply_entries")
    timed(bulkcopy, "copy_pairs", capture=lambda a, k, o: captured["pairs"].append(list(a[0])))
    timed(bulkcopy, "_bounced_h2d")
    timed(torch.optim.Optimizer, "load_state_dict", "optim_load")
    timed(M.CheckpointManager, "_prepare_pending_buffers", "prepare_buffers")
    if os.environ.get("PROBE_NO_ARENA") == "1":  # no staging arena made after a restore (nor torn down by close)
        M.CheckpointManager._prepare_pending_buffers = lambda self: None
    orig_rfv = fastload.read_file_verified

    def rfv(path, size, where, meanwhile=None):
        if meanwhile is not None:
            inner = meanwhile

            def meanwhile(buf):  # noqa: F811
                t0 = time.perf_counter()
                try:
                    inner(buf)
                finally:
                    add("parse", time.perf_counter() - t0)
        return orig_rfv(path, size, where, meanwhile=meanwhile)
    fastload.read_file_verified = rfv

    recs = []
    gpu_scratch = None
    for r in range(rounds):
        B.zero_live(C.state_tensors(model, opt), dev)
        C.collect()
        marks.clear()
        captured["pairs"].clear()
        captured["bufs"].clear()
        mgr = C.make_manager(d, {"model": model, "optim": opt}, keep_last=None, compression=None)
        try:
            dev.sync()
            prof = None
            if os.environ.get("PROBE_PROFILE") == "1" and r == rounds - 1:  # the last round under cProfile
                import cProfile

                prof = cProfile.Profile()
                prof.enable()
            t0 = time.perf_counter()
            step = mgr.restore_latest()
            dev.sync()
            total = time.perf_counter() - t0
            if prof is not None:
                import pstats

                prof.disable()
                print(f"cProfile of round {r}'s restore_latest ({total * 1e3:.1f} ms under the profiler):")
                pstats.Stats(prof).sort_stats("tottime").print_stats(30)
                pstats.Stats(prof).sort_stats("cumulative").print_stats(40)
            rec = {"total": total, **marks, "ok": step == 1 and B.check(model, opt, ref)}
            t_close = time.perf_counter()
            mgr.close()  # its staging arena (prepared after the restore) released before the diagnostics
            rec["close"] = time.perf_counter() - t_close
            time.sleep(float(os.environ.get("PROBE_SLEEP", "0.5")))
            # diagnostics with the restore's buffers still mapped
            pairs = captured["pairs"][0] if captured["pairs"] else []
            diag: dict[str, float] = {}

            def t(name, fn):
                dev.sync()
                t1 = time.perf_counter()
                fn()
                dev.sync()
                diag[name] = time.perf_counter() - t1
            if pairs and dev.cuda:
                t("again1", lambda: bulkcopy.copy_pairs(pairs))
                t("again2", lambda: bulkcopy.copy_pairs(pairs))
                flat = [(bulkcopy.flat_bytes(a), bulkcopy.flat_bytes(b)) for a, b in pairs if bulkcopy.raw_copyable(a, b)]
                small = [p for p in flat if p[0].numel() < bulkcopy.PACK_BELOW_BYTES]
                large = [p for p in flat if p[0].numel() >= bulkcopy.PACK_BELOW_BYTES]
                t("small", lambda: bulkcopy._bounced_h2d(dev.device, small))
                t("large", lambda: bulkcopy._bounced_h2d(dev.device, large))
                t("large2", lambda: bulkcopy._bounced_h2d(dev.device, large))
                big = max(b.numel() for _, b in captured["bufs"])
                if gpu_scratch is None or gpu_scratch.numel() < big:
                    gpu_scratch = torch.empty(big, dtype=torch.uint8, device=dev.device)
                t("contig", lambda: [bulkcopy._bounced_h2d(dev.device, [(gpu_scratch[:b.numel()], b)]) for _, b in captured["bufs"]])
                t("contig2", lambda: [bulkcopy._bounced_h2d(dev.device, [(gpu_scratch[:b.numel()], b)]) for _, b in captured["bufs"]])
                rec.update(n_pairs=len(pairs), n_small=len(small), n_large=len(large),
                           small_bytes=sum(p[0].numel() for p in small), large_bytes=sum(p[0].numel() for p in large))
                rec["ok_after"] = B.check(model, opt, ref)
            files = [p for p, _ in captured["bufs"]]
            rec["files"] = len(files)
            captured["pairs"].clear()
            captured["bufs"].clear()
            pairs = []
            C.collect()
            # the verified read's halves apart, on fresh mappings of the same files
            maps = []
            for p in files:
                fd = os.open(p, os.O_RDONLY)
                try:
                    maps.append(fastload._map_file(fd, os.fstat(fd).st_size))
                finally:
                    os.close(fd)
            step_b = fastload.MAP_CRC_BYTES

            def populate_all():
                tasks = []
                for m in maps:
                    for a in range(0, m.numel(), step_b):
                        tasks.append(functools.partial(pagemem.populate_read, m.data_ptr() + a, min(step_b, m.numel() - a)))
                ptlayout.run_tasks(tasks)

            def crc_all():
                tasks = []
                for m in maps:
                    v = fastload.byte_view(m)
                    for a in range(0, m.numel(), step_b):
                        tasks.append(functools.partial(crc32, v[a:a + step_b], 0))
                ptlayout.run_tasks(tasks)
            t("populate", populate_all)
            t("crc", crc_all)
            del maps
            rec.update(diag)
        finally:
            mgr.close()
        recs.append(rec)
        print(f"round {r}: " + "  ".join(f"{k} {v * 1e3:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in rec.items()), flush=True)
    keys = [k for k in recs[-1] if isinstance(recs[-1][k], float)]
    print("\nms over rounds (first / best / median):")
    for k in keys:
        xs = [x[k] * 1e3 for x in recs if k in x]
        print(f"  {k:18s} {xs[0]:7.1f} {min(xs):7.1f} {statistics.median(xs):7.1f}")
    print("all ok:", all(x.get("ok") and x.get("ok_after", True) for x in recs))
    if out:
        with open(out, "w") as f:
            json.dump({"state": st, "rounds": rounds, "results": recs}, f, indent=1)
    import shutil

    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
