python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L
B="python3 benchmarks/bench_stall.py --state-gb 5 --every 100 --ckpts 3 --dir /dev/shm/ckd-h25"
echo "== A host25, files made ahead (new default)"
timeout 110 $B --prefault-gb 20 --methods none,checkpointd_host25 --json $OUT/host25-ahead-s22i.json 2>&1 | grep -E "^none|^checkpointd" | cut -c1-140
date -u
echo "== B host25, CHECKPOINTD_FILES_AHEAD=0 (session 22's first change only)"
CHECKPOINTD_FILES_AHEAD=0 timeout 100 $B --prefault-gb 0 --methods none,checkpointd_host25 --json $OUT/host25-noahead-s22i.json 2>&1 | grep -E "^none|^checkpointd" | cut -c1-140
date -u
echo "== tests of the changed code on a CUDA host"
timeout 100 python3 -m pytest -q tests/test_recycle.py tests/test_arena_pieces.py tests/test_persist_process.py tests/test_host_budget.py tests/gpu/test_host_budget_cuda.py -p no:cacheprovider --timeout 60 -rf --tb=short 2>&1 | tail -4 | cut -c1-300
date -u
