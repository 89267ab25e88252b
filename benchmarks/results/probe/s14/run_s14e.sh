set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1
date -u
for v in src .probe/v-9d01369/src .probe/v-d0093de/src .probe/v-565a950/src .probe/v-0820f8e/src src; do
echo "== $v"
PYTHONPATH=/tmp/site:$PWD/$v timeout 80 python3 benchmarks/bench_persist.py --state-gb 5 --repeat 2 --dirs /dev/shm/ckd-p --methods checkpointd_zstd --json $OUT/zstd-$(echo $v | tr / _).json 2>&1 | grep -E "^checkpointd" | cut -c1-150
done
echo "== HEAD recycle off"
PYTHONPATH=/tmp/site:$PWD/src CHECKPOINTD_RECYCLE=0 timeout 80 python3 benchmarks/bench_persist.py --state-gb 5 --repeat 2 --dirs /dev/shm/ckd-p --methods checkpointd_zstd 2>&1 | grep -E "^checkpointd" | cut -c1-150
date -u
