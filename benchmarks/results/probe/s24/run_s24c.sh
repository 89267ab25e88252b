python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
mkdir -p $OUT/c
date -u; nvidia-smi -L; nproc
echo "== CUDA tests and the files changed since the last GPU run (3eaaf03..HEAD)"
timeout 280 python3 -m pytest -q tests/gpu tests/test_fast_restore.py tests/test_persist_process.py tests/test_recycle.py tests/test_host_budget.py -p no:cacheprovider --timeout 200 -rfs --tb=short > $OUT/c/tests-s24c.log 2>&1
echo "exit $?"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/c/tests-s24c.log | tail -8 | cut -c1-250
date -u
echo "== restore, mapped (the process uses CUDA) against read"
timeout 120 python3 benchmarks/bench_restore.py --state-gb 5 --dirs /dev/shm/ckd-r --methods raw,checkpointd,checkpointd_nommap,checkpointd_cold --raw-threads max --repeat 3 --json $OUT/c/restore-s24c.json 2>&1 | grep -E "^raw|^checkpointd|rror" | cut -c1-160
rm -rf /dev/shm/ckd-r
date -u
echo "== run_gpu.sh compression"
STAGES=compression WHEELS=.whl OUT=$OUT/c/rungpu BUDGET_S=150 PREFAULT_GB=0 timeout 170 bash benchmarks/run_gpu.sh > $OUT/c/rungpu-c.log 2>&1
echo "exit $?"; grep -A30 "== compression" $OUT/c/rungpu-c.log | tail -25 | cut -c1-200
date -u
cd $OUT && tar czf c.tgz c && rm -rf c
