"""Session 28 probe: what a verify-first restore from tmpfs moves through host memory, pass by pass.

One file of GB gigabytes in /dev/shm, mapped as a restore maps it (``fastload``); each row best of
REPEAT, the rows interleaved. Host traffic counts bytes read plus bytes written in host memory
(a DMA reads its pinned source once):

- crc: the checksum pass (32 MiB ranges on checkpointd's I/O threads): reads 1x;
- copy: the mapping copied into a pinned buffer by torch's intra-op threads: reads 1x, writes 1x;
- dma: the pinned buffer to the GPU: reads 1x;
- bounce: checkpointd's apply copy (``bulkcopy._bounced_h2d``: 16 MiB pinned chunks, DMA behind): 3x;
  also with 4, 2 and 64 MiB chunks (small chunks may still be in the cache when their DMA reads them);
- crc || bounce: both at once (the device image's arrangement): 4x;
- crc || copy: both at once: 3x;
- raw: ``os.preadv`` into the pinned buffer from 16 threads (bench_restore's raw read): 2x.

If every row that saturates the host lands at about the same traffic rate, host memory bandwidth is
the floor, and a restore that stages through pinned memory moves at least 3x the file where the raw
read moves 2x.

Run: python benchmarks/results/probe/s28/mem_floor_probe.py [GB] [REPEAT] [--json out.json]
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import torch

from checkpointd import bulkcopy, fastload, ptlayout
from checkpointd.crc import crc32
from checkpointd.streams import byte_view


def main() -> None:
    gb = float(sys.argv[1]) if len(sys.argv) > 1 else 4.83
    repeat = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    out = sys.argv[sys.argv.index("--json") + 1] if "--json" in sys.argv else None
    n = int(gb * 1e9) // (1 << 20) * (1 << 20)
    path = "/dev/shm/ckd-memfloor.bin"
    src = torch.randint(0, 255, (64 << 20,), dtype=torch.uint8)
    with open(path, "wb") as f:
        for a in range(0, n, src.numel()):
            f.write(src[: min(src.numel(), n - a)].numpy().tobytes())
    fd = os.open(path, os.O_RDONLY)
    mapped = fastload._map_file(fd, n)
    view = byte_view(mapped)
    step = fastload.MAP_CRC_BYTES
    ranges = [(a, min(n, a + step)) for a in range(0, n, step)]
    t0 = time.perf_counter()
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    pin_s = time.perf_counter() - t0
    gpu = torch.empty(n, dtype=torch.uint8, device="cuda")
    threads = min(16, os.cpu_count() or 16)

    def crc():
        ptlayout.run_tasks([lambda a=a, b=b: (fastload.pagemem.populate_read(mapped.data_ptr() + a, b - a),
                                              crc32(view[a:b], 0)) for a, b in ranges])

    def copy():
        with bulkcopy._intra_op_threads(threads):
            pinned.copy_(mapped)

    def dma():
        gpu.copy_(pinned, non_blocking=True)
        torch.cuda.synchronize()

    def bounce():
        bulkcopy._bounced_h2d(gpu.device, [(gpu, mapped)])

    def bounce_mb(mb):
        def run():
            os.environ[bulkcopy.CHUNK_ENV] = str(mb)
            try:
                bulkcopy._bounced_h2d(gpu.device, [(gpu, mapped)])
            finally:
                del os.environ[bulkcopy.CHUNK_ENV]
        return run

    def both(f, g):
        def run():
            box = []
            t = threading.Thread(target=lambda: box.append(f()))
            t.start()
            g()
            t.join()
        return run

    def raw():
        chunk = 64 << 20
        pv = memoryview(pinned.numpy())
        rfd = os.open(path, os.O_RDONLY)
        try:
            ptlayout.run_tasks([lambda a=a: os.preadv(rfd, [pv[a:min(n, a + chunk)]], a) for a in range(0, n, chunk)])
        finally:
            os.close(rfd)

    rows = {"crc": (crc, 1), "copy": (copy, 2), "dma": (dma, 1), "bounce": (bounce, 3), "bounce 4 MiB": (bounce_mb(4), 3), "bounce 2 MiB": (bounce_mb(2), 3),
            "bounce 64 MiB": (bounce_mb(64), 3),
            "crc || bounce": (both(crc, bounce), 4), "crc || copy": (both(crc, copy), 3), "raw": (raw, 2)}
    times: dict[str, list[float]] = {k: [] for k in rows}
    for name, (fn, _) in rows.items():
        fn()  # warm: page tables, pools, chunks
    for _ in range(repeat):
        for name, (fn, _) in rows.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t0)
    print(f"{gb:.2f} GB file in /dev/shm, {threads} threads, io pool {ptlayout.io_threads()}, pinning {pin_s:.2f} s")
    print(f"{'row':16s} {'best ms':>8s} {'median':>8s} {'x file':>6s} {'host GB/s':>10s}")
    res = {}
    for name, (fn, factor) in rows.items():
        ts = sorted(times[name])
        best, med = ts[0], ts[len(ts) // 2]
        res[name] = {"times_s": times[name], "traffic_x": factor, "host_GBps": factor * n / best / 1e9}
        print(f"{name:16s} {best * 1e3:8.1f} {med * 1e3:8.1f} {factor:6d} {factor * n / best / 1e9:10.1f}")
    if out:
        with open(out, "w") as f:
            json.dump({"bytes": n, "threads": threads, "pin_s": pin_s, "rows": res}, f, indent=1)
    os.close(fd)
    os.unlink(path)


if __name__ == "__main__":
    main()
