python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L
echo "== CUDA tests of the host budget and the persist process"
timeout 150 python3 -m pytest -q tests/gpu/test_host_budget_cuda.py tests/test_host_budget.py tests/test_persist_process.py tests/test_early_writeback.py -p no:cacheprovider 2>&1 | tail -4
date -u
B="python3 benchmarks/bench_stall.py --state-gb 5 --every 100 --ckpts 3 --dir /dev/shm/ckd-h25"
echo "== A new: chunks written by the persist process"
timeout 140 $B --prefault-gb 20 --methods none,checkpointd_host25 --json $OUT/host25-new-s22a.json 2>&1 | grep -E "^none|^checkpointd" | cut -c1-140
date -u
echo "== B old: CHECKPOINTD_PERSIST_PROCESS=0 (ring in private memory, in-process pwrite)"
CHECKPOINTD_PERSIST_PROCESS=0 timeout 140 $B --prefault-gb 0 --methods none,checkpointd_host25 --json $OUT/host25-old-s22a.json 2>&1 | grep -E "^none|^checkpointd" | cut -c1-140
date -u
echo "== C new again"
timeout 140 $B --prefault-gb 0 --methods none,checkpointd_host25 --json $OUT/host25-new2-s22a.json 2>&1 | grep -E "^none|^checkpointd" | cut -c1-140
date -u
