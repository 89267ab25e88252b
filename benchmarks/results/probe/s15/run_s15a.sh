set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; nproc; python3 -c "from checkpointd import crc; print('crc', crc.CRC32_IMPLEMENTATION)"
timeout 240 python3 -m pytest -q tests/gpu tests/test_persist_process.py tests/test_recycle.py tests/test_host_budget.py tests/test_early_writeback.py tests/test_snapshot.py -p no:cacheprovider 2>&1 | grep -v "^  " | tail -8 | cut -c1-300
date -u
F=CHECKPOINTD_DEVICE_PACE_MB=1024+CHECKPOINTD_DEVICE_PACE_STEP_MB=0
timeout 300 python3 benchmarks/bench_stall.py --state-gb 5 --methods none,checkpointd_device,checkpointd_device@CHECKPOINTD_DEVICE_CLONE=call,checkpointd_device@$F,checkpointd_device,checkpointd_device@CHECKPOINTD_DEVICE_CLONE=call,checkpointd_device@$F,none --dir /dev/shm/ckd --json $OUT/stall-s15a-5gb-device.json 2>&1 | grep -v "stats()\|construction" | tail -12 | cut -c1-240
date -u
