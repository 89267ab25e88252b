set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
date -u; nvidia-smi -L
timeout 100 python3 -m pytest -q -x tests/gpu/test_cuda_paths.py -p no:cacheprovider 2>&1 | tail -3
timeout 120 python3 .probe/first_copy.py 2.42 3 2>&1 | tail -2
timeout 120 python3 .probe/first_copy.py 4.83 2 2>&1 | tail -1
date -u
W0=checkpointd@CHECKPOINTD_WARM_ARENA=0
timeout 240 python3 benchmarks/bench_stall.py --state-gb 2.5 --every 60 --ckpts 4 \
  --methods none,$W0,checkpointd,$W0,checkpointd,checkpointd@CHECKPOINTD_WARM_ARENA=tiny,copy_only,none \
  --dir /dev/shm/ckd --json $OUT/stall-s12a-2.5gb.json 2>&1 | tail -14 | cut -c1-170
date -u
timeout 240 python3 benchmarks/bench_stall.py --state-gb 5 --every 60 --ckpts 4 \
  --methods none,$W0,checkpointd,$W0,checkpointd,copy_only,none \
  --dir /dev/shm/ckd --json $OUT/stall-s12a-5gb.json 2>&1 | tail -13 | cut -c1-170
date -u
