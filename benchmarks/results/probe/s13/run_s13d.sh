set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L
timeout 240 python3 -m pytest -q tests/gpu tests/test_persist_process.py tests/test_recycle.py tests/test_host_budget.py tests/test_early_writeback.py tests/test_snapshot.py -p no:cacheprovider 2>&1 | grep -v "^  " | tail -12 | cut -c1-300
date -u
timeout 250 python3 benchmarks/bench_stall.py --state-gb 20 --every 60 --ckpts 3 \
  --methods none,checkpointd_device,checkpointd,none --dir /dev/shm/ckd --json $OUT/stall-s13d-20gb.json 2>&1 | grep -v "stats()\|construction" | tail -8 | cut -c1-220
date -u
