python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; nproc; python3 -c "import torch; print('intra-op threads', torch.get_num_threads())"
mkdir -p $OUT/s32c
P=benchmarks/results/probe/s32
rm -rf /dev/shm/ckd*
echo "== phases: reserved ahead (copies on cores the reservations leave) against reserved when written"
timeout 80 python3 $P/persist_probe.py --gb 5 --saves 4 --raw-reps 1 --variants noahead_pause,noreserve_pause,noahead_pause,noreserve_pause \
  --json $OUT/s32c/persist-probe-s32c.json > $OUT/s32c/persist-probe-s32c.log 2>&1
echo "exit $?"; grep -E "^==|^  save" $OUT/s32c/persist-probe-s32c.log | cut -c1-150
rm -rf /dev/shm/ckd*
date -u
for on in cpu device; do
echo "== bench_persist.py tmpfs, state on $on, repeat 3"
timeout 150 python3 benchmarks/bench_persist.py --state-gb 5 --state-on $on --dirs /dev/shm/ckd-persist --repeat 3 --raw-threads max \
  --methods raw,checkpointd,checkpointd_noreserve \
  --json $OUT/s32c/persist-$on-s32c.json > $OUT/s32c/persist-$on-s32c.log 2>&1
echo "exit $?"; sed -n '/^-- /,$p' $OUT/s32c/persist-$on-s32c.log | cut -c1-200
rm -rf /dev/shm/ckd*
date -u
done
echo "== bench_stall.py: none / checkpointd interleaved (keep_last 1: files from the bin, taken at reservation)"
timeout 200 python3 benchmarks/bench_stall.py --state-gb 5 --dir /dev/shm/ckd-stall --methods none,checkpointd,none,checkpointd,none \
  --json $OUT/s32c/stall-s32c.json > $OUT/s32c/stall-s32c.log 2>&1
echo "exit $?"; grep -E "checkpointd|none|target|interleaved" $OUT/s32c/stall-s32c.log | tail -14 | cut -c1-220
rm -rf /dev/shm/ckd*
date -u
cd $OUT && tar czf s32c.tgz s32c && rm -rf s32c
