set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-nong .whl/zstandard*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1
date -u
python3 -c "import zlib_ng" 2>&1 | tail -1
for v in src .probe/head/src src .probe/head/src; do
i=$((i+1)); echo "== $v"
PYTHONPATH=/tmp/site:$PWD/$v timeout 80 python3 benchmarks/bench_persist.py --state-gb 5 --repeat 2 --dirs /dev/shm/ckd-p --methods checkpointd,checkpointd_zstd --json $OUT/persist-s14f-$i-$(echo $v | tr /. __).json 2>&1 | grep -E "^checkpointd" | cut -c1-150
done
date -u
for s in /tmp/site-nong /tmp/site /tmp/site-nong /tmp/site; do
echo "== restore with $s"
PYTHONPATH=$s:$PWD/src timeout 100 python3 benchmarks/bench_restore.py --state-gb 5 --repeat 3 --raw-threads 16 --dirs /dev/shm/ckd-restore --methods raw,checkpointd 2>&1 | grep -E "raw read|restore_latest " | tail -3
done
date -u
PYTHONPATH=/tmp/site:$PWD/src timeout 200 python3 benchmarks/bench_stall.py --state-gb 5 --every 100 --ckpts 3 \
  --methods none,checkpointd_zstd,checkpointd,none --dir /dev/shm/ckd --json $OUT/stall-s14f-5gb-zstd.json 2>&1 | grep -v "stats()\|construction" | tail -8 | cut -c1-200
date -u
