set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u
for l in 1 2 4; do
echo "== lanes $l"
CHECKPOINTD_COMPRESSED_WRITE_LANES=$l timeout 80 python3 benchmarks/bench_persist.py --state-gb 5 --repeat 2 --dirs /dev/shm/ckd-p --methods checkpointd_zstd --json $OUT/persist-s14i-lanes$l.json 2>&1 | grep -E "^checkpointd" | cut -c1-150
done
date -u
L=CHECKPOINTD_COMPRESSED_WRITE_LANES
timeout 200 python3 benchmarks/bench_stall.py --state-gb 5 --every 100 --ckpts 3 \
  --methods none,checkpointd_zstd@$L=2,checkpointd_zstd@$L=1,checkpointd_zstd@CHECKPOINTD_PARALLEL_WRITE=0,none --dir /dev/shm/ckd --json $OUT/stall-s14i-5gb-zstd.json 2>&1 | grep -v "stats()\|construction" | tail -7 | cut -c1-200
date -u
