set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L
timeout 100 python3 benchmarks/diagnose_thread_cpu.py --state-gb 0.5 --saves 8 --every 30 --dir /dev/shm/ckd-tc --json $OUT/thread-cpu-s12f-05gb-blocking.json 2>&1 | grep "^{" | cut -c1-260
CHECKPOINTD_SPIN_WAIT=1 timeout 100 python3 benchmarks/diagnose_thread_cpu.py --state-gb 0.5 --saves 8 --every 30 --dir /dev/shm/ckd-tc --json $OUT/thread-cpu-s12f-05gb-spin.json 2>&1 | grep "^{" | cut -c1-260
date -u
S1=checkpointd@CHECKPOINTD_SPIN_WAIT=1
timeout 220 python3 benchmarks/bench_stall.py --state-gb 0.5 --every 60 --ckpts 20 \
  --methods none,$S1,checkpointd,$S1,checkpointd,none --dir /dev/shm/ckd --json $OUT/stall-s12f-05gb.json 2>&1 | grep -v "stats()\|construction" | tail -8 | cut -c1-200
date -u
timeout 150 python3 -m pytest -q -x tests/gpu/test_cuda_paths.py tests/gpu/test_host_budget_cuda.py -p no:cacheprovider 2>&1 | tail -2
date -u
