set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u
timeout 450 python3 benchmarks/bench_stall.py --state-gb 20 --every 60 --ckpts 3 \
  --methods none,checkpointd_device,clone_only,io_only_reuse,none --dir /dev/shm/ckd --json $OUT/stall-s14b-20gb.json 2>&1 | grep -v "stats()\|construction" | tail -10 | cut -c1-220
date -u
