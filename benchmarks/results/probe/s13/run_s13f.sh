set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u
M=checkpointd_device@CHECKPOINTD_DEVICE_CLONE=memcpy
timeout 280 python3 benchmarks/bench_stall.py --state-gb 20 --every 60 --ckpts 3 \
  --methods none,$M,checkpointd_device,$M,none --dir /dev/shm/ckd --json $OUT/stall-s13f-20gb.json 2>&1 | grep -v "stats()\|construction" | tail -8 | cut -c1-220
date -u
timeout 100 python3 benchmarks/bench_stall.py --state-gb 5 --every 60 --ckpts 5 \
  --methods none,checkpointd_device,$M,checkpointd,none --dir /dev/shm/ckd --json $OUT/stall-s13f-5gb.json 2>&1 | grep -v "stats()\|construction" | tail -7 | cut -c1-220
date -u
