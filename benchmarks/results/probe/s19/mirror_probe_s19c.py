"""s19 probe: restore from tmpfs with the bytes crossing the host once (a GPU mirror of the file).

Variants on one 4.83 GB file in /dev/shm (ms, best / median of 5 interleaved tries):
  raw        16-thread preadv into a touched pinned buffer (bench_restore's raw ceiling)
  today      read_file_verified (map + 16-thread CRC), then copy_pairs(live <- mapping) (bounce)
  mirror_C_T ring of pinned slots of C MiB, T threads: each task preadv's its C MiB range into a slot
             in 1 MiB slices, CRC-32 of each slice as it lands, then queues the slot's DMA into a GPU
             buffer the file's size; all DMAs waited for; then live <- mirror device to device
Prints one JSON line; writes it to argv[2] if given.
"""
import ctypes, json, mmap, os, queue, sys, time, statistics
from concurrent.futures import ThreadPoolExecutor
import torch
from checkpointd import fastload, bulkcopy, pagemem, ptlayout
from checkpointd.crc import crc32, crc32_combine

gb = float(sys.argv[1]) if len(sys.argv) > 1 else 4.83
out_path = sys.argv[2] if len(sys.argv) > 2 else None
size = int(gb * 1e9) // (1 << 20) * (1 << 20)
path = "/dev/shm/ckd-mirror.bin"
dev = torch.device("cuda")
t0 = time.perf_counter()
with open(path, "wb") as f:
    step = 256 << 20
    for a in range(0, size, step):
        n = min(step, size - a)
        f.write(torch.randn(n // 4, device=dev).cpu().numpy().tobytes())
print(f"wrote {size/1e9:.2f} GB in {time.perf_counter()-t0:.1f} s", flush=True)
live = torch.empty(size, dtype=torch.uint8, device=dev)
pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
pinned.fill_(1)
ref_crc = None


def today():
    buf, n, c = fastload.read_file_verified(path, size, "probe")
    bulkcopy.copy_pairs([(live, buf)])
    return c


def raw():
    fd = os.open(path, os.O_RDONLY)
    try:
        view = memoryview(pinned.numpy()).cast("B")
        step = 64 << 20

        def task(a):
            b = min(size, a + step)
            got = 0
            while got < b - a:
                got += os.preadv(fd, [view[a + got:b]], a + got)
            return b - a
        ptlayout.run_tasks([lambda a=a: task(a) for a in range(0, size, step)])
    finally:
        os.close(fd)


_rings = {}
_pools = {}
SLICE = 1 << 20
phase = {}


def mirror(name, chunk_mb, threads, d2d=True, one_stream=False, whole=False, do_crc=True, do_dma=True, cudart=False, nslots=None, source="read", populate=True):
    chunk = chunk_mb << 20
    nslots = nslots or threads + 4
    key = (chunk, nslots, one_stream)
    if key not in _rings:
        ring = torch.empty(nslots * chunk, dtype=torch.uint8, pin_memory=True)
        streams = [torch.cuda.Stream(dev) for _ in range(1 if one_stream else nslots)]
        _rings[key] = (ring, streams)
    ring, streams = _rings[key]
    if threads not in _pools:
        _pools[threads] = ThreadPoolExecutor(threads)
    pool = _pools[threads]
    slots = queue.SimpleQueue()
    events = [None] * nslots
    for i in range(nslots):
        slots.put(i)
    ring_view = memoryview(ring.numpy()).cast("B")
    ring_ptr = ring.data_ptr()
    gpu = torch.empty(size, dtype=torch.uint8, device=dev)
    gpu_ptr = gpu.data_ptr()
    rt = torch.cuda.cudart()
    fd = os.open(path, os.O_RDONLY)
    mbuf = fastload._map_file(fd, size) if source == "map" else None
    map_ptr = mbuf.data_ptr() if mbuf is not None else 0
    acc = {"wait": 0.0, "read": 0.0, "crc": 0.0, "launch": 0.0}
    lock = __import__("threading").Lock()

    def task(a):
        t0 = time.perf_counter()
        b = min(size, a + chunk)
        i = slots.get()
        ev = events[i]
        if ev is not None:
            ev.synchronize()
        t1 = time.perf_counter()
        base = i * chunk
        crc = 0
        pos = a
        tr = tc = 0.0
        step = (b - a) if whole else SLICE
        while pos < b:
            e = min(b, pos + step)
            part = ring_view[base + pos - a: base + e - a]
            x = time.perf_counter()
            if source == "map":
                if populate and pos == a:
                    pagemem.populate_read(map_ptr + a, b - a)
                ctypes.memmove(ring_ptr + base + pos - a, map_ptr + pos, e - pos)
            else:
                got = 0
                while got < part.nbytes:
                    n = os.preadv(fd, [part[got:]], pos + got)
                    if n <= 0:
                        raise EOFError
                    got += n
            y = time.perf_counter()
            if do_crc:
                crc = crc32(part, crc)
            tc += time.perf_counter() - y
            tr += y - x
            pos = e
        t2 = time.perf_counter()
        if do_dma:
            s = streams[i % len(streams)]
            if cudart:
                rt.cudaMemcpyAsync(gpu_ptr + a, ring_ptr + base, b - a, 1, s.cuda_stream)
                ev = torch.cuda.Event()
                ev.record(s)
            else:
                with torch.cuda.stream(s):
                    gpu[a:b].copy_(ring[base: base + b - a], non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(s)
            events[i] = ev
        slots.put(i)
        t3 = time.perf_counter()
        with lock:
            acc["wait"] += t1 - t0; acc["read"] += tr; acc["crc"] += tc; acc["launch"] += t3 - t2
        return crc

    try:
        starts = list(range(0, size, chunk))
        crcs = list(pool.map(task, starts))
        for ev in events:
            if ev is not None:
                ev.synchronize()
    finally:
        os.close(fd)
    c = 0
    for a, x in zip(starts, crcs):
        c = crc32_combine(c, x, min(size, a + chunk) - a)
    if d2d and do_dma:
        live.copy_(gpu)
        torch.cuda.synchronize()
    del gpu, mbuf
    phase[name] = {k: round(v * 1e3, 1) for k, v in acc.items()}
    return "%08x" % c


def crc_only():
    """today's first pass alone (map + 16-thread CRC)"""
    buf, n, c = fastload.read_file_verified(path, size, "probe")
    return c


V = {}
variants = {"raw": raw, "today": today, "today_crc_pass": crc_only}
specs = {
    "m16": dict(chunk_mb=16, threads=16),
    "m16_whole": dict(chunk_mb=16, threads=16, whole=True),
    "m64": dict(chunk_mb=64, threads=16),
    "map16": dict(chunk_mb=16, threads=16, source="map"),
    "map16_nopop": dict(chunk_mb=16, threads=16, source="map", populate=False),
    "map32": dict(chunk_mb=32, threads=16, source="map"),
    "map16_t12": dict(chunk_mb=16, threads=12, source="map"),
    "map16_nodma": dict(chunk_mb=16, threads=16, source="map", do_dma=False),
    "map16_nocrc": dict(chunk_mb=16, threads=16, source="map", do_crc=False),
}
for k, kw in specs.items():
    variants[k] = (lambda k=k, kw=kw: mirror(k, **kw))


def ring_register(nslots=20, chunk=16 << 20):
    """what a registered ring costs: anonymous mapping, pages written, cudaHostRegister, then unregistered"""
    n = nslots * chunk
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = torch.frombuffer(m, dtype=torch.uint8)
    t0 = time.perf_counter()
    pagemem.populate_write(t.data_ptr(), n)
    t1 = time.perf_counter()
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), n, 0)
    t2 = time.perf_counter()
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
    phase["ring_register"] = {"populate": round((t1 - t0) * 1e3, 1), "register": round((t2 - t1) * 1e3, 1), "err": int(err)}
    del t
    m.close()


def ring_pinned(nslots=20, chunk=16 << 20):
    t = torch.empty(nslots * chunk, dtype=torch.uint8, pin_memory=True)
    del t
    torch._C._host_emptyCache()


variants["ring_register_320MiB"] = ring_register
variants["ring_pinned_320MiB"] = ring_pinned
times = {k: [] for k in variants}
first = {}
crcs = {}
for k, fn in variants.items():  # first call of each: pools, pinned rings, kernels
    torch.cuda.synchronize()
    t = time.perf_counter()
    crcs[k] = fn()
    torch.cuda.synchronize()
    first[k] = round((time.perf_counter() - t) * 1e3, 1)
today_crc = crcs["today"]
mirror_crc_ok = {k: v == today_crc for k, v in crcs.items() if k.startswith("m") and "nocrc" not in k}
live_ok = torch.equal(live[-(1 << 20):].cpu(), torch.from_file(path, size=size, dtype=torch.uint8)[-(1 << 20):])
for r in range(5):
    for k, fn in variants.items():
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times[k].append(round((time.perf_counter() - t) * 1e3, 1))
res = {"gb": size / 1e9, "mirror_crc_ok": mirror_crc_ok, "live_ok": bool(live_ok), "io_threads": ptlayout.io_threads(),
       "crc_impl": __import__("checkpointd.crc", fromlist=["x"]).CRC32_IMPLEMENTATION,
       "card": torch.cuda.get_device_name(), "ms": times, "first": first,
       "phase_ms_last": dict(phase),
       "best": {k: min(v) for k, v in times.items()}, "median": {k: statistics.median(v) for k, v in times.items()}}
print(json.dumps(res), flush=True)
for k in variants:
    print(f"{k:20s} {str(res['phase_ms_last'].get(k, '')):60s} best {res['best'][k]:7.1f}  median {res['median'][k]:7.1f}  first {first[k]:7.1f}  x raw {res['best']['raw']/res['best'][k]:.2f}")
if out_path:
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)
os.unlink(path)
