set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L
timeout 250 python3 benchmarks/bench_stall.py --state-gb 20 --every 60 --ckpts 3 \
  --methods none,checkpointd_device,checkpointd,none --dir /dev/shm/ckd --json $OUT/stall-s13c-20gb.json 2>&1 | grep -v "stats()\|construction" | tail -8 | cut -c1-220
date -u
PYTHONPATH=/tmp/site:$PWD/.probe/old/src timeout 180 python3 benchmarks/bench_stall.py --state-gb 20 --every 60 --ckpts 3 \
  --methods none,checkpointd_device,none --dir /dev/shm/ckd --json $OUT/stall-s13c-20gb-old.json 2>&1 | grep -v "stats()\|construction" | tail -6 | cut -c1-220
date -u
timeout 130 python3 benchmarks/bench_stall.py --state-gb 5 --every 60 --ckpts 5 \
  --methods none,checkpointd_device,checkpointd,none --dir /dev/shm/ckd --json $OUT/stall-s13c-5gb.json 2>&1 | grep -v "stats()\|construction" | tail -8 | cut -c1-220
date -u
