set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u
timeout 100 python3 .probe/zstd_prof.py 5 2>&1 | tail -12 | cut -c1-250
date -u
for n in 10 0 10 0; do
echo "== CHECKPOINTD_COMPRESS_NICE=$n"
CHECKPOINTD_COMPRESS_NICE=$n timeout 120 python3 benchmarks/bench_stall.py --state-gb 5 --every 100 --ckpts 3 \
  --methods none,checkpointd_zstd,none --dir /dev/shm/ckd --json $OUT/stall-s14g-zstd-nice$n-$RANDOM.json 2>&1 | grep -v "stats()\|construction" | tail -4 | cut -c1-200
done
date -u
