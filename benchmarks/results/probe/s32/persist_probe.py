"""Session 32 probe: where a checkpointd save into new tmpfs files spends its time, against raw writes.

Part 1 (raw, no library): the phases of a mapped write of new files (posix_fallocate, then threads
copying into the mapping, then fsync), for one file of the whole state and for the checkpoint's two
files (model, optimizer) at once; and the same without posix_fallocate (the copies' page faults
allocate), and with posix_fallocate split over threads.
Part 2 (library): saves of the reference state (pinned CPU tensors, as bench_persist.py) by one manager
per variant (env), each save timed as bench_persist.py does, its step directory removed after it;
variants: the defaults, no blank files ahead (CHECKPOINTD_FILES_AHEAD=0), and the same with a pause
after the removal (the persist process lets go of a deleted file's mapping, and so its pages, within
0.5 s: without a pause that happens inside the next timed save).

s32b-s32c ran it against the reservation ahead (since removed; variant noreserve_pause), s32d against
the pipelined reservation in the persist process (noahead_pause: pipelined, the default; nopipe_pause: not).

Run: python persist_probe.py [--gb 5] [--root /dev/shm/ckd-s32] [--saves 5] [--variants a,b,c] [--json out]
"""
from __future__ import annotations

import argparse, json, mmap, os, shutil, subprocess, sys, threading, time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", ".."))  # benchmarks/
import common as C  # noqa: E402
import torch  # noqa: E402
import numpy as np  # noqa: E402

CHUNK = 64 << 20


def raw_phases(root, views, groups, threads, mode):
    """mode: 'falloc' (one posix_fallocate a file), 'nofalloc' (ftruncate; faults allocate),
    'falloc_par' (posix_fallocate in `threads` ranges at once)."""
    os.makedirs(root, exist_ok=True)
    paths = [os.path.join(root, f"f{k}.bin") for k in range(len(groups))]
    sizes = [sum(len(views[i]) for i in g) for g in groups]
    t0 = time.perf_counter()
    fds = [os.open(p, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o644) for p in paths]

    def reserve(k):
        if mode == "falloc":
            os.posix_fallocate(fds[k], 0, sizes[k])
        elif mode == "nofalloc":
            os.ftruncate(fds[k], sizes[k])
        else:
            os.ftruncate(fds[k], sizes[k])
            step = -(-sizes[k] // threads)
            with ThreadPoolExecutor(threads) as ex:
                list(ex.map(lambda s: os.posix_fallocate(fds[k], s, min(step, sizes[k] - s)), range(0, sizes[k], step)))

    ths = [threading.Thread(target=reserve, args=(k,)) for k in range(len(fds))]
    [t.start() for t in ths]
    [t.join() for t in ths]
    t1 = time.perf_counter()
    maps = [mmap.mmap(fd, s, access=mmap.ACCESS_WRITE) for fd, s in zip(fds, sizes)]
    dests = [np.frombuffer(m, dtype=np.uint8) for m in maps]
    tasks = []
    for k, g in enumerate(groups):
        off = 0
        for i in g:
            v = views[i]
            for s in range(0, len(v), CHUNK):
                tasks.append((k, v[s:s + CHUNK], off + s))
            off += len(v)
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(lambda t: np.copyto(dests[t[0]][t[2]:t[2] + len(t[1])], np.frombuffer(t[1], dtype=np.uint8)), tasks))
    t2 = time.perf_counter()
    del dests
    for m in maps:
        m.close()
    for fd in fds:
        os.fsync(fd)
        os.close(fd)
    t3 = time.perf_counter()
    shutil.rmtree(root, ignore_errors=True)
    t4 = time.perf_counter()
    return {"total": t3 - t0, "reserve": t1 - t0, "copy": t2 - t1, "close": t3 - t2, "rmtree": t4 - t3}


def library_saves(root, model, opt, dev, saves, env, pause):
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        shutil.rmtree(root, ignore_errors=True)
        mgr = C.make_manager(root, {"model": model, "optim": opt}, keep_last=None, max_pending=1, compression=None)
        out = []
        for step in range(1, saves + 2):
            C.collect()
            dev.sync()
            t0 = time.perf_counter()
            mgr.maybe_save(step, force=True)
            tb = time.perf_counter()
            mgr.wait_for_snapshot()
            ts = time.perf_counter()
            mgr.wait()
            t1 = time.perf_counter()
            ls = dict(mgr.stats().get("last_save") or {})
            rec = {"step": step, "total": t1 - t0, "block": tb - t0, "snapshot": ts - t0,
                   "write": ls.get("write_secs"), "plan": ls.get("plan_secs"), "stage_wait": ls.get("stage_wait_secs"),
                   "recycled": ls.get("files_recycled"), "reserve": ls.get("reserve_secs")}
            tc = time.perf_counter()
            for x in os.listdir(root):
                if x.startswith("step-"):
                    shutil.rmtree(os.path.join(root, x), ignore_errors=True)
            rec["clear"] = time.perf_counter() - tc
            if pause:
                time.sleep(pause)
            out.append(rec)
            print(f"  save {step}: " + " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in rec.items()), flush=True)
        mgr.close()
        shutil.rmtree(root, ignore_errors=True)
        return out
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


VARIANTS = {
    "default": ({}, 0.0),
    "noahead": ({"CHECKPOINTD_FILES_AHEAD": "0"}, 0.0),
    "noahead_pause": ({"CHECKPOINTD_FILES_AHEAD": "0"}, 1.5),
    "default_pause": ({}, 1.5),
    "noreserve_pause": ({"CHECKPOINTD_FILES_AHEAD": "0", "CHECKPOINTD_RESERVE_AHEAD": "0"}, 1.5),  # s32b-s32c
    "nopipe_pause": ({"CHECKPOINTD_FILES_AHEAD": "0", "CHECKPOINTD_RESERVE_PIPELINE": "0"}, 1.5),  # s32d
}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--gb", type=float, default=5.0)
    p.add_argument("--root", default="/dev/shm/ckd-s32")
    p.add_argument("--saves", type=int, default=5)
    p.add_argument("--threads", type=int, default=min(16, os.cpu_count() or 1))
    p.add_argument("--raw-reps", type=int, default=2)
    p.add_argument("--variants", default="default,noahead,noahead_pause,default_pause")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    dev = C.Dev(cpu=not torch.cuda.is_available())
    model, opt, st = C.build_train_state(a.gb, None, None, dev, on="cpu")
    ts = C.state_tensors(model, opt)
    views = C.byte_views(ts)
    n_model = sum(1 for _ in model.parameters())
    res = {"state": st, "threads": a.threads, "raw": [], "library": {}}
    print(f"state {st['state_bytes'] / 1e9:.2f} GB, {len(views)} tensors, threads {a.threads}", flush=True)
    layouts = {"one file": [list(range(len(views)))], "model+optim": [list(range(n_model)), list(range(n_model, len(views)))]}
    for rep in range(a.raw_reps):
        for lname, groups in layouts.items():
            for mode in ("falloc", "nofalloc", "falloc_par"):
                r = raw_phases(a.root + "-raw", views, groups, a.threads, mode)
                r.update(layout=lname, mode=mode, rep=rep)
                res["raw"].append(r)
                print(f"raw {lname:12s} {mode:10s}: total {r['total']:.3f} reserve {r['reserve']:.3f} copy {r['copy']:.3f} "
                      f"close+fsync {r['close']:.3f} (rmtree {r['rmtree']:.3f})", flush=True)
    for v in a.variants.split(","):
        env, pause = VARIANTS[v]
        print(f"== library {v} {env} pause {pause}", flush=True)
        res["library"][v] = library_saves(a.root, model, opt, dev, a.saves, env, pause)
        if a.json:
            json.dump(res, open(a.json, "w"), indent=1)
    r = raw_phases(a.root + "-raw", views, layouts["model+optim"], a.threads, "falloc")
    print(f"raw model+optim falloc (after): total {r['total']:.3f} reserve {r['reserve']:.3f} copy {r['copy']:.3f}", flush=True)
    res["raw"].append(dict(r, layout="model+optim", mode="falloc", rep="after"))
    if a.json:
        json.dump(res, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
