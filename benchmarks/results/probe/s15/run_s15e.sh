set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L
timeout 200 python3 -m pytest -q tests/gpu tests/test_persist_process.py tests/test_recycle.py tests/test_host_budget.py tests/test_early_writeback.py tests/test_snapshot.py -p no:cacheprovider 2>&1 | grep -v "^  " | tail -4 | cut -c1-300
date -u
timeout 190 python3 benchmarks/bench_stall.py --state-gb 5 --dir /dev/shm/ckd-bench/stall --methods none,checkpointd,checkpointd_device,dcp_async,checkpointd,checkpointd_device,none --json $OUT/stall-s15e-5gb.json 2>&1 | grep -v "stats()\|construction" | grep -v "^   " | tail -10 | cut -c1-200
date -u
