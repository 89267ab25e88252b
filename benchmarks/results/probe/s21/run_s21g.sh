python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L
B="python3 benchmarks/bench_stall.py --state-gb 5 --every 100 --ckpts 3 --dir /dev/shm/ckd-h25"
echo "== host25, in-process writes by pwrite (default)"
timeout 200 $B --prefault-gb 20 --methods none,checkpointd_host25,none --json $OUT/host25-pwrite-s21g.json 2>&1 | grep -v "^\[stall\] " | grep -E "^method|^---|^none|^checkpointd|staging|stats" | cut -c1-250
date -u
echo "== host25, CHECKPOINTD_WRITE_MODE=auto (mapped writes on tmpfs)"
CHECKPOINTD_WRITE_MODE=auto timeout 200 $B --prefault-gb 0 --methods none,checkpointd_host25,none --json $OUT/host25-auto-s21g.json 2>&1 | grep -v "^\[stall\] " | grep -E "^method|^---|^none|^checkpointd|staging|stats" | cut -c1-250
date -u
