set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; free -g | head -2
# first touch of the VM's memory (hypothesis: a fresh lease's first writes to new guest pages are slow)
timeout 150 python3 -c "
import time, torch
held = []
for i in range(3):
    t0 = time.perf_counter(); held.append(torch.ones(28 << 28, dtype=torch.float32)); dt = time.perf_counter() - t0
    print(f'first touch {i}: 28 GiB in {dt:.2f} s ({28 / dt:.1f} GiB/s)', flush=True)
held.clear()
for i in range(2):
    t0 = time.perf_counter(); a = torch.ones(28 << 28, dtype=torch.float32); dt = time.perf_counter() - t0
    print(f'again {i}: 28 GiB in {dt:.2f} s ({28 / dt:.1f} GiB/s)', flush=True); del a
"
date -u
D=checkpointd_device
timeout 400 python3 benchmarks/bench_stall.py --state-gb 5 --methods none,$D,$D@CHECKPOINTD_DEVICE_CLONE=call,$D,$D@CHECKPOINTD_DEVICE_CLONE=call,$D,$D@CHECKPOINTD_DEVICE_CLONE=call,clone_only,none --dir /dev/shm/ckd --json $OUT/stall-s15c-5gb-device.json 2>&1 | grep -v "stats()\|construction" | tail -13 | cut -c1-170
date -u
