python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; uname -r
B="--state-gb 5 --every 100 --ckpts 3 --dir /dev/shm/ckd-h25 --prefault-gb 20 --methods none,checkpointd_host25"
for v in pop nopop pop2; do
  flag=""; [ $v = nopop ] && flag="--no-populate"
  echo "== $v: host25 timeline, background populating yields to saves"
  timeout 110 python3 .probe/host25_timeline.py $OUT/tl-$v-s23b.json $flag -- $B --json $OUT/host25-$v-s23b.json 2>&1 | grep -E "^none|^checkpointd|^EV|^SAVE|rror" | cut -c1-260
  date -u
done
echo "== tests of the changed code on a CUDA host"
timeout 150 python3 -m pytest -q tests/test_persist_process.py tests/test_host_budget.py tests/gpu/test_host_budget_cuda.py tests/test_recycle.py tests/test_arena_pieces.py -p no:cacheprovider --timeout 60 -rf --tb=short 2>&1 | tail -4 | cut -c1-300
date -u
