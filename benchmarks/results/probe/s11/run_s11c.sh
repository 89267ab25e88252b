set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1
NEW=/tmp/site:$PWD/src; OLD=/tmp/site:$PWD/.probe/old_src/src
date -u; nvidia-smi -L
PYTHONPATH=$NEW timeout 200 python3 -m pytest -q -x tests/gpu tests/test_persist_process.py tests/test_recycle.py -p no:cacheprovider 2>&1 | tail -4
date -u
for code in NEW OLD NEW OLD; do
  eval P=\$$code
  PYTHONPATH=$P timeout 100 python3 benchmarks/bench_stall.py --state-gb 0.5 --every 60 --ckpts 20 --methods none,checkpointd,none \
    --dir /dev/shm/ckd --json $OUT/stall-s11c-05gb-$code-$RANDOM.json 2>&1 | grep -E "^(none|checkpointd)" | cut -c1-150 | sed "s/^/$code /"
done
date -u
PYTHONPATH=$NEW timeout 200 python3 benchmarks/bench_stall.py --state-gb 5 --every 60 --ckpts 8 --methods none,checkpointd,checkpointd_device,none \
  --dir /dev/shm/ckd --json $OUT/stall-s11c-5gb.json 2>&1 | tail -12
date -u
