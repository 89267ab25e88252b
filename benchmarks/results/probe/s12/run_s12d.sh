set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L
timeout 200 python3 benchmarks/bench_stall.py --state-gb 0.5 --every 60 --ckpts 20 \
  --methods none,copy_only,io_only_reuse,checkpointd,copy_only,checkpointd,none --dir /dev/shm/ckd --json $OUT/stall-s12d-05gb.json 2>&1 | grep -v "stats()\|construction" | tail -9 | cut -c1-200
date -u
