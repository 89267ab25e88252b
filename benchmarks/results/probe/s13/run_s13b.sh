set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L
timeout 240 python3 -m pytest -q -x tests/gpu tests/test_persist_process.py tests/test_recycle.py tests/test_host_budget.py tests/test_early_writeback.py tests/test_snapshot.py -p no:cacheprovider 2>&1 | tail -3
date -u
for lib in new old; do
  P=/tmp/site:$PWD/src; [ $lib = old ] && P=/tmp/site:$PWD/.probe/old/src
  for mode in "" "--device-staging"; do
    PYTHONPATH=$P timeout 90 python3 .probe/call_phases.py --d 256 --layers 33 --saves 16 $mode --json $OUT/call-$lib${mode:+-device}-L33.json 2>&1 | grep "^{" | cut -c1-700
  done
done
date -u
timeout 200 python3 benchmarks/bench_stall.py --state-gb 0.5 --every 60 --ckpts 20 \
  --methods none,checkpointd_device,checkpointd,checkpointd_device,checkpointd,none --dir /dev/shm/ckd --json $OUT/stall-s13b-05gb.json 2>&1 | grep -v "stats()\|construction" | tail -9 | cut -c1-220
date -u
