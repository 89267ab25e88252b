python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; nproc
B="python3 benchmarks/bench_stall.py --state-gb 5 --every 100 --ckpts 3"
echo "== A: the defaults (pinned), files made ahead once the arena is page-locked (new)"
timeout 150 $B --dir /dev/shm/ckd-stall --prefault-gb 20 --methods none,checkpointd --json $OUT/stall-default-s23f.json 2>&1 | grep -E "^none|^checkpointd|rror|targets" | cut -c1-220
date -u
echo "== B: the defaults with CHECKPOINTD_FILES_AHEAD=0"
CHECKPOINTD_FILES_AHEAD=0 timeout 150 $B --dir /dev/shm/ckd-stall --prefault-gb 0 --methods none,checkpointd --json $OUT/stall-noahead-s23f.json 2>&1 | grep -E "^none|^checkpointd|rror|targets" | cut -c1-220
date -u
echo "== C: host budget 25 % (new)"
timeout 110 python3 .probe/host25_timeline.py $OUT/tl-host25-s23f.json -- --state-gb 5 --every 100 --ckpts 3 --dir /dev/shm/ckd-h25 --prefault-gb 0 --methods none,checkpointd_host25 --json $OUT/host25-s23f.json 2>&1 | grep -E "^none|^checkpointd|^EV|^SAVE|rror" | cut -c1-230
date -u
timeout 100 python3 -m pytest -q tests/test_recycle.py tests/gpu/test_host_budget_cuda.py -p no:cacheprovider --timeout 60 -rf --tb=short 2>&1 | tail -3 | cut -c1-300
date -u
