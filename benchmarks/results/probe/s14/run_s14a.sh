set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; nproc
timeout 240 python3 -m pytest -q tests/gpu tests/test_persist_process.py tests/test_recycle.py tests/test_host_budget.py tests/test_early_writeback.py tests/test_snapshot.py -p no:cacheprovider 2>&1 | grep -v "^  " | tail -12 | cut -c1-300
date -u
timeout 60 python3 .probe/call_phases.py --d 256 --layers 33 --saves 16 --profile --json $OUT/s14a-call-pinned.json 2>&1 | head -40 | cut -c1-200
timeout 60 python3 .probe/call_phases.py --d 256 --layers 33 --saves 16 --profile --device-staging --json $OUT/s14a-call-device.json 2>&1 | head -40 | cut -c1-200
date -u
timeout 200 python3 benchmarks/bench_stall.py --state-gb 5 --every 60 --ckpts 5 \
  --methods none,checkpointd_device,checkpointd,checkpointd_device,checkpointd,none --dir /dev/shm/ckd --json $OUT/stall-s14a-5gb.json 2>&1 | grep -v "stats()\|construction" | tail -10 | cut -c1-220
date -u
