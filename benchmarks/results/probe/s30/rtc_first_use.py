"""Session 30 probe: the NVRTC-built CRC-32 kernels' first use in a fresh process, and their speed.

One fresh process per call: torch's CUDA start (untimed for the verdict), then
``device_crc.kernel_available`` (the kernels compiled by NVRTC, or loaded from the disk cache in
``CHECKPOINTD_CACHE_DIR``; which one is printed), the first ``crc32_of`` of 4 MiB and a second one.
``--big GB``: then a buffer of that many random bytes on the GPU, its CRC ``--repeat`` times (ms), and
the CRC of its first 1 GiB against zlib's of the same bytes copied to the host.

Run: python benchmarks/results/probe/s30/rtc_first_use.py [--big 4.83] [--repeat 5]
"""

import json
import sys
import time
import zlib

t0 = time.perf_counter()
import torch  # noqa: E402

torch.zeros(1, device="cuda")
torch.cuda.synchronize()
t1 = time.perf_counter()
from checkpointd import cuda_rtc, device_crc, kernel_cache  # noqa: E402

t2 = time.perf_counter()
dev = torch.device("cuda", torch.cuda.current_device())
ok = device_crc.kernel_available(dev)
t3 = time.perf_counter()
buf = torch.randint(0, 256, (4 << 20,), dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
t4 = time.perf_counter()
c1 = device_crc.crc32_of(buf)
torch.cuda.synchronize()
t5 = time.perf_counter()
c2 = device_crc.crc32_of(buf)
torch.cuda.synchronize()
t6 = time.perf_counter()
out = {"torch_and_cuda_s": t1 - t0, "import_s": t2 - t1, "kernel_available_s": t3 - t2, "available": ok,
       "origin": dict((("/".join(k[0:1]) + f":{k[1]}"), v) for k, v in cuda_rtc.load_origin.items()),
       "first_crc_s": t5 - t4, "second_crc_s": t6 - t5,
       "crc_ok": c1 == c2 == zlib.crc32(buf.cpu().numpy().tobytes()), "cache_dir": str(kernel_cache.cache_dir())}
if "--big" in sys.argv:
    gb = float(sys.argv[sys.argv.index("--big") + 1])
    rep = int(sys.argv[sys.argv.index("--repeat") + 1]) if "--repeat" in sys.argv else 5
    n = int(gb * 1e9) // 4 * 4 + 12344  # a tail past the last whole lane
    big = torch.empty(n, dtype=torch.uint8, device="cuda")
    big.view(torch.int32)[: n // 4].random_()
    host_tail = big[device_crc.tail_start(n):].cpu().numpy().tobytes()
    times = []
    crcs = []
    for _ in range(rep):
        torch.cuda.synchronize()
        a = time.perf_counter()
        crcs.append(device_crc.crc32_of(big, host_tail=host_tail))
        torch.cuda.synchronize()
        times.append((time.perf_counter() - a) * 1e3)
    g = 1 << 30
    head = big[:g]
    out.update(big_bytes=n, big_ms=times, big_same=len(set(crcs)) == 1,
               gib_ok=device_crc.crc32_of(head) == zlib.crc32(head.cpu().numpy().tobytes()))
print(json.dumps(out))
