set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1
date -u
for r in 1 2; do
for cfg in "src 1" ".probe/head/src 1" "src 0"; do
set -- $cfg; v=$1; pw=$2
echo "== $v parallel_write=$pw"
CHECKPOINTD_PARALLEL_WRITE=$pw PYTHONPATH=/tmp/site:$PWD/$v timeout 80 python3 benchmarks/bench_persist.py --state-gb 5 --repeat 2 --dirs /dev/shm/ckd-p --methods checkpointd_zstd --json $OUT/persist-s14h-$r-$(echo $v | tr /. __)-pw$pw.json 2>&1 | grep -E "^checkpointd" | cut -c1-150
done
done
date -u
PYTHONPATH=/tmp/site:$PWD/src timeout 100 python3 .probe/zstd_prof.py 5 2>&1 | tail -12 | cut -c1-250
date -u
PYTHONPATH=/tmp/site:$PWD/src timeout 150 python3 benchmarks/bench_stall.py --state-gb 5 --every 100 --ckpts 3 \
  --methods none,checkpointd_zstd,checkpointd,none --dir /dev/shm/ckd --json $OUT/stall-s14h-5gb-zstd.json 2>&1 | grep -v "stats()\|construction" | tail -6 | cut -c1-200
date -u
