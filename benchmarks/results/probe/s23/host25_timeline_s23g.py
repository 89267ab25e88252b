"""Probe (s23): where the host-budget first save's extra time goes. Runs bench_stall.py in this process
with a timeline recorded: files made ahead (start/end), recycle.take results, each put's send/answer,
each save's call, and the persist process's page faults and CPU time sampled every 5 ms.
usage: host25_timeline.py OUT.json -- bench_stall args..."""
import json, os, runpy, sys, threading, time

out_path = sys.argv[1]
bench_args = sys.argv[sys.argv.index("--") + 1:]
T0 = time.perf_counter()
events = []


def ev(kind, **kw):
    events.append(dict(t=round(time.perf_counter() - T0, 5), kind=kind, **kw))


from checkpointd import manager, persist_process, recycle  # noqa: E402

from checkpointd import snapshot  # noqa: E402

_register = snapshot.StagingArena._register_pinned


def register_pinned(self):
    ev("register_start", nbytes=self._slab.nbytes)
    ok = _register(self)
    ev("register_end", nbytes=self._slab.nbytes, ok=ok)
    return ok
snapshot.StagingArena._register_pinned = register_pinned

_make = recycle.FilesAhead._make


def make(self, nbytes):
    ev("make_start", n=nbytes)
    ok = _make(self, nbytes)
    ev("make_end", n=nbytes, ok=ok)
    return ok
recycle.FilesAhead._make = make
_take = recycle.take


def take(directory, path, nbytes):
    ok = _take(directory, path, nbytes)
    ev("take", n=nbytes, ok=ok, path=os.path.basename(path))
    return ok
recycle.take = take
_submit = persist_process.RemoteFile.submit


def submit(self, tasks):
    sent = time.perf_counter() - T0
    n = sum(t[3] for task in tasks for t in task)
    fut = _submit(self, tasks)
    fut.add_done_callback(lambda _f: ev("put", n=n, sent=round(sent, 5), file=self.file_id))
    return fut
persist_process.RemoteFile.submit = submit
_maybe = manager.CheckpointManager.maybe_save


def maybe_save(self, step, *a, **k):
    t = time.perf_counter()
    started = _maybe(self, step, *a, **k)
    if started:
        ev("save", step=step, call_ms=round((time.perf_counter() - t) * 1e3, 3))
    return started
manager.CheckpointManager.maybe_save = maybe_save

samples = []
stop = threading.Event()


def stat(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
        return int(rest[7]), int(rest[9]), int(rest[11]), int(rest[12])  # minflt majflt utime stime
    except OSError:
        return None


def sampler():
    tick = os.sysconf("SC_CLK_TCK")
    last = None
    while not stop.wait(0.005):
        c = persist_process._client
        pid = c.proc.pid if c is not None and c.alive else None
        s = stat(pid) if pid else None
        me = stat(os.getpid())
        row = (pid, s, me)
        if row[:2] != last:
            samples.append([round(time.perf_counter() - T0, 4), pid, s, me, tick])
            last = row[:2]
threading.Thread(target=sampler, daemon=True).start()

sys.argv = ["bench_stall.py"] + bench_args
try:
    runpy.run_path("benchmarks/bench_stall.py", run_name="__main__")
finally:
    stop.set()
    with open(out_path, "w") as f:
        json.dump({"events": events, "samples": samples}, f)
    # summary per save: puts between this save and the next
    saves = [e for e in events if e["kind"] == "save"]
    puts = [e for e in events if e["kind"] == "put"]
    for e in events:
        if e["kind"] in ("make_start", "make_end", "take", "register_start", "register_end"):
            print("EV", e)
    for i, s in enumerate(saves):
        end = saves[i + 1]["t"] if i + 1 < len(saves) else 1e9
        ps = [p for p in puts if s["t"] <= p["sent"] < end]
        if not ps:
            print("SAVE", s, "no puts"); continue
        t_first, t_last = min(p["sent"] for p in ps), max(p["t"] for p in ps)
        lat = sorted(p["t"] - p["sent"] for p in ps)
        pid_s = [x for x in samples if x[2] is not None and t_first - 0.01 <= x[0] <= t_last + 0.02]
        flt = cpu = None
        if len(pid_s) >= 2:
            a, b = pid_s[0][2], pid_s[-1][2]
            flt = b[0] - a[0]; cpu = (b[2] + b[3] - a[2] - a[3]) / pid_s[0][4]
        print(f"SAVE step {s['step']} at {s['t']:.3f} call {s['call_ms']} ms: {len(ps)} puts "
              f"{sum(p['n'] for p in ps)/1e9:.2f} GB from {t_first - s['t']:.3f} to {t_last - s['t']:.3f} s; "
              f"put latency median {lat[len(lat)//2]*1e3:.1f} max {lat[-1]*1e3:.1f} ms; "
              f"persist minflt {flt} cpu {cpu} s")
