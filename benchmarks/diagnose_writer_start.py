"""Diagnosis (CUDA): what a background action costs the training steps that run beside it.

The issue-6 workload trains with a synchronisation per step; between two steps a background action
starts, and the per-step excess over the median step of this process is printed for the steps after.
Actions: ``pwrite:T:F[:NICE]`` (T threads write a pinned state-sized buffer into F tmpfs files, 1 MiB
CRC+pwrite slices like checkpointd's writer), ``crc:T`` (CRC only), ``gil:MS`` (pure Python for MS
ms), ``ckd`` (a real checkpointd save, with a timeline of the writer's phases and of every garbage
collection). ``--freeze`` calls gc.freeze() first. Session 3 used it to find that the excess after
the copy came from full garbage collections and from 16 threads writing one file (RESULTS.md).

python3 benchmarks/diagnose_writer_start.py --state-gb 5 --scen none,pwrite:16:1,pwrite:4:1,pwrite:1:1,pwrite:16:16,crc:16,gil:50,ckd
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import threading
import time
import zlib

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import common as C  # noqa: E402

EV: list[tuple[float, str]] = []


def ev(name):
    EV.append((time.perf_counter(), name))


def _gc_cb(phase, info):
    ev(f"gc.{phase} gen{info.get('generation')} coll={info.get('collected')}")


def _wrap(owner, name, label, on_start=None):
    """Replace ``owner.name`` by a wrapper that logs ``label.start`` / ``label.end`` around each call."""
    inner = getattr(owner, name)

    def wrapper(*a, **k):
        ev(f"{label}.start")
        if on_start is not None:
            on_start()
        try:
            return inner(*a, **k)
        finally:
            ev(f"{label}.end")
    setattr(owner, name, wrapper)


_INSTRUMENTED = []


def instrument():
    """Log the writer's phases (planning, the wait for the copies, writing), the first and every 128th write task of each file, and every collection."""
    if _INSTRUMENTED:
        return
    _INSTRUMENTED.append(True)
    import gc
    gc.callbacks.append(_gc_cb)
    import checkpointd.storage.ptlayout as PL
    import checkpointd.save.writer as W

    import checkpointd.save.snapshot as S

    _wrap(W.BackgroundWriter, "_process", "process")
    _wrap(W.BackgroundWriter, "plan_job", "plan")
    _wrap(S.PendingCopies, "wait_host", "copy_wait")
    _wrap(W.BackgroundWriter, "write_files", "write_files")
    puts = {"n": 0}
    inner_put = PL._put_task

    def _put_task(put, work):
        puts["n"] += 1
        if puts["n"] <= 2 or puts["n"] % 128 == 0:
            ev(f"put#{puts['n']}")
        return inner_put(put, work)
    PL._put_task = _put_task
    _wrap(PL, "write_image", "write_image", on_start=lambda: puts.update(n=0))


def bg_pwrite(buf: torch.Tensor, threads: int, files: int, root: str, nice: int):
    mv = memoryview(buf.numpy()).cast("B")
    n = mv.nbytes
    os.makedirs(root, exist_ok=True)
    fds = [os.open(os.path.join(root, f"f{i}"), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644) for i in range(files)]
    per = (n + files - 1) // files
    for i, fd in enumerate(fds):
        os.ftruncate(fd, max(0, min(per, n - i * per)))
    task = 8 << 20
    jobs = [(i, off) for i in range(files) for off in range(0, max(0, min(per, n - i * per)), task)]
    lock = threading.Lock()
    it = iter(jobs)

    def worker():
        if nice:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        while True:
            with lock:
                j = next(it, None)
            if j is None:
                return
            i, off = j
            base = i * per + off
            end = min(base + task, (i + 1) * per, n)
            pos = base
            while pos < end:
                part = mv[pos:min(pos + (1 << 20), end)]
                zlib.crc32(part)
                os.pwrite(fds[i], part, pos - i * per)
                pos += part.nbytes
    ends = []

    def run():
        worker()
        ends.append(time.perf_counter())
    wait, t0 = _start_threads([run] * threads)

    def join():
        wait()
        dt = max(ends) - t0
        for fd in fds:
            os.close(fd)
        for i in range(files):
            os.unlink(os.path.join(root, f"f{i}"))
        return n / dt / 1e9
    return join


def _start_threads(targets):
    """Start one thread per target; returns (a function that joins them all, the start time)."""
    ths = [threading.Thread(target=fn) for fn in targets]
    t0 = time.perf_counter()
    for t in ths:
        t.start()

    def wait():
        for t in ths:
            t.join()
    return wait, t0


def bg_crc(buf, threads):
    mv = memoryview(buf.numpy()).cast("B")
    n = mv.nbytes
    per = n // threads

    def worker(i):
        for pos in range(i * per, (i + 1) * per, 1 << 20):
            zlib.crc32(mv[pos:pos + (1 << 20)])
    wait, t0 = _start_threads([functools.partial(worker, i) for i in range(threads)])

    def join():
        wait()
        return n / (time.perf_counter() - t0) / 1e9
    return join


def bg_gil(ms):
    def worker():
        end = time.perf_counter() + ms / 1e3
        x = 0
        while time.perf_counter() < end:
            x += 1
    t = threading.Thread(target=worker)
    t.start()
    return lambda: (t.join(), 0.0)[1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--state-gb", type=float, default=5)
    ap.add_argument("--scen", default="none,pwrite:16:1,pwrite:4:1,pwrite:1:1,pwrite:16:16,crc:16,gil:50,ckd")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--dir", default="/dev/shm/ws")
    ap.add_argument("--json", default=None)
    ap.add_argument("--freeze", action="store_true")
    a = ap.parse_args()
    dev = C.Dev(cpu=False)
    d, L = C.shape_for_gb(a.state_gb)
    torch.manual_seed(0)
    model = C.make_model(d, L, dev.device)
    opt = C.make_optimizer(model, dev)
    x = torch.randn(8, 512, d, device=dev.device)
    C.fill_adam_state(model, opt)
    state_bytes = C.nbytes(C.state_tensors(model, opt))
    import gc
    for _ in range(3):
        t0 = time.perf_counter(); gc.collect(); print(f"gc.collect() {1e3*(time.perf_counter()-t0):.1f} ms, objects {len(gc.get_objects())}", flush=True)
    print("gc thresholds", gc.get_threshold(), gc.get_count(), flush=True)
    if a.freeze:
        gc.freeze()

    def step():
        with torch.autocast(dev.device.type, dtype=torch.bfloat16):
            y = model(x)
        y.float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(10):
        step()
    dev.sync()
    base = []
    for _ in range(40):
        t0 = time.perf_counter()
        step()
        dev.sync()
        base.append(time.perf_counter() - t0)
    med = sorted(base)[len(base) // 2]
    print(f"state {state_bytes/1e9:.2f} GB, D={d} L={L}, median step {med*1e3:.2f} ms", flush=True)
    buf = None
    out = {"median_ms": med * 1e3, "state_gb": state_bytes / 1e9, "scen": {}}
    for scen in a.scen.split(","):
        kind, *ps = scen.split(":")
        rows = []
        for rep in range(a.reps):
            mgr = None
            if kind in ("pwrite", "crc") and buf is None:
                buf = torch.empty(state_bytes, dtype=torch.uint8, pin_memory=dev.cuda)
                buf.fill_(7)
            if kind == "ckd":
                import checkpointd as ckd
                instrument()
                EV.clear()
                C.clean_dir(a.dir)
                mgr = ckd.CheckpointManager(a.dir, {"model": model, "optim": opt}, every_n_steps=1000, keep_last=1, compression=None)
                mgr.maybe_save(0)  # prepares buffers (first maybe_save), no save at step 0? force one below
                mgr.wait()
                for _ in range(5):
                    step()
                dev.sync()
                time.sleep(1.0)
                EV.clear()
            join = None
            times = []
            for i in range(30):
                t0 = time.perf_counter()
                if kind == "ckd":
                    with torch.autocast(dev.device.type, dtype=torch.bfloat16):
                        y = model(x)
                    y.float().pow(2).mean().backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    if i == 5:
                        dev.sync()
                        ev("save.call")
                        mgr.save(1000 + rep)
                        ev("save.return")
                else:
                    step()
                    if i == 5:
                        dev.sync()
                        if kind == "pwrite":
                            join = bg_pwrite(buf, int(ps[0]), int(ps[1]), a.dir, int(ps[2]) if len(ps) > 2 else 0)
                        elif kind == "crc":
                            join = bg_crc(buf, int(ps[0]))
                        elif kind == "gil":
                            join = bg_gil(float(ps[0]))
                dev.sync()
                times.append((t0, time.perf_counter()))
            gbps = join() if join else None
            if mgr is not None:
                mgr.wait()
                mgr.close()
                C.clean_dir(a.dir)
            ex = [(t1 - t0 - med) * 1e3 for t0, t1 in times]
            w = ex[5:26]
            rows.append({"excess_ms": ex, "window_sum_ms": sum(w), "gbps": gbps,
                         "events": [(round((t - times[5][0]) * 1e3, 2), n) for t, n in EV]})
            print(f"{scen:16s} rep{rep} window {sum(w):8.1f} ms  steps[5..12] " +
                  " ".join(f"{e:6.1f}" for e in ex[5:13]) + (f"  bg {gbps:.2f} GB/s" if gbps else ""), flush=True)
            if kind == "ckd":
                starts = [round((t0 - times[5][0]) * 1e3, 1) for t0, _ in times[5:12]]
                print("   step starts (ms from save step start):", starts)
                for t, n in EV[:60]:
                    print(f"   {1e3 * (t - times[5][0]):9.2f} {n}")
                EV.clear()
        out["scen"][scen] = rows
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
