python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; nproc
mkdir -p $OUT/s32d
P=benchmarks/results/probe/s32
rm -rf /dev/shm/ckd*
echo "== tests: the pipelined reservation (a real tmpfs each)"
timeout 60 python3 -m pytest -q -p no:cacheprovider -rf --tb=short tests/test_reserve_pipeline.py > $OUT/s32d/pytest-s32d.log 2>&1
echo "exit $?"; grep -E "FAILED|ERROR|passed|failed" $OUT/s32d/pytest-s32d.log | tail -5 | cut -c1-200
echo "== phases: reserved range by range beside the copies (default) against whole first; no files ahead, a pause after each removal"
timeout 100 python3 $P/persist_probe.py --gb 5 --saves 4 --raw-reps 1 --variants noahead_pause,nopipe_pause,noahead_pause,nopipe_pause \
  --json $OUT/s32d/persist-probe-s32d.json > $OUT/s32d/persist-probe-s32d.log 2>&1
echo "exit $?"; grep -E "^raw model|^==|^  save" $OUT/s32d/persist-probe-s32d.log | cut -c1-150
rm -rf /dev/shm/ckd*
date -u
for on in cpu device; do
echo "== bench_persist.py tmpfs, state on $on, repeat 3"
timeout 150 python3 benchmarks/bench_persist.py --state-gb 5 --state-on $on --dirs /dev/shm/ckd-persist --repeat 3 --raw-threads max \
  --methods raw,checkpointd,checkpointd_nopipeline,checkpointd_recycle \
  --json $OUT/s32d/persist-$on-s32d.json > $OUT/s32d/persist-$on-s32d.log 2>&1
echo "exit $?"; sed -n '/^-- /,$p' $OUT/s32d/persist-$on-s32d.log | cut -c1-200
rm -rf /dev/shm/ckd*
date -u
done
cd $OUT && tar czf s32d.tgz s32d && rm -rf s32d
