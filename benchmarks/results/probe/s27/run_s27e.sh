python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L
mkdir -p $OUT/s27e
rm -rf /dev/shm/ckd*
timeout 175 python3 benchmarks/bench_stall.py --state-gb 5 --every 100 --ckpts 3 --prefault-gb 8 \
  --methods none,checkpointd,none,checkpointd,none,checkpointd,none --dir /dev/shm/ckd-s --json $OUT/s27e/stall-pinned.json > $OUT/s27e/stall-pinned.log 2>&1
echo "exit $?"; grep -v "^\[stall\] " $OUT/s27e/stall-pinned.log | grep -v "stats()\|construction" | tail -24 | cut -c1-250
rm -rf /dev/shm/ckd*
date -u
