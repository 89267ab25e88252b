python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; nproc
B="python3 benchmarks/bench_stall.py --state-gb 5 --every 100 --ckpts 3 --dir /dev/shm/ckd-stall"
echo "== A: the defaults (pinned), files made ahead (session 22 on), populated in ranges that yield (session 23)"
timeout 150 $B --prefault-gb 20 --methods none,checkpointd --json $OUT/stall-default-s23e.json 2>&1 | grep -E "^none|^checkpointd|rror|target" | cut -c1-220
date -u
echo "== B: the defaults with CHECKPOINTD_FILES_AHEAD=0"
CHECKPOINTD_FILES_AHEAD=0 timeout 150 $B --prefault-gb 0 --methods none,checkpointd --json $OUT/stall-noahead-s23e.json 2>&1 | grep -E "^none|^checkpointd|rror|target" | cut -c1-220
date -u
