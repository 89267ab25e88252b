"""Session 29 probe: what the device checksum's first use costs a fresh process (a resumed job's restore).

Each run is a fresh process: ``import triton.language`` timed, then the first ``device_crc.crc32_of`` of
4 MiB on the GPU (the kernel compiled, or loaded from Triton's cache in ``TRITON_CACHE_DIR``), then a
second call. The caller empties the cache before the first run (cold) and keeps it for the next (warm).

Run: python benchmarks/results/probe/s29/triton_first_use.py
"""

import json
import time

t0 = time.perf_counter()
import torch  # noqa: E402

torch.zeros(1, device="cuda")
torch.cuda.synchronize()
t1 = time.perf_counter()
import triton.language  # noqa: E402,F401

t2 = time.perf_counter()
from checkpointd import device_crc  # noqa: E402

buf = torch.randint(0, 256, (4 << 20,), dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
t3 = time.perf_counter()
device_crc.crc32_of(buf)
torch.cuda.synchronize()
t4 = time.perf_counter()
device_crc.crc32_of(buf)
torch.cuda.synchronize()
t5 = time.perf_counter()
print(json.dumps({"torch_and_cuda_s": t1 - t0, "import_triton_s": t2 - t1, "first_crc_s": t4 - t3, "second_crc_s": t5 - t4}))
