python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; nproc; git log --oneline -1 2>/dev/null; git status --short 2>/dev/null | head; python3 -c "import zlib_ng, zstandard; print('zlib_ng ok')"
mkdir -p $OUT/s28a
echo "== GPU tests (tests/gpu)"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tail -8
date -u
R="python3 benchmarks/bench_restore.py --state-gb 5 --dirs /dev/shm/ckd-restore --raw-threads 8,max"
echo "== restore tmpfs: defaults (device image) against no image, fresh process, phases"
rm -rf /dev/shm/ckd*
timeout 220 $R --repeat 5 --methods raw,checkpointd,checkpointd_noimage,checkpointd_cold,checkpointd_phases --json $OUT/s28a/restore-s28a.json > $OUT/s28a/restore-s28a.log 2>&1
echo "exit $?"; grep -A30 "^-- /dev/shm" $OUT/s28a/restore-s28a.log | cut -c1-200
date -u
for v in CHECKPOINTD_RESTORE_THREADS=8 CHECKPOINTD_RESTORE_CHUNK_MB=32; do
  echo "== variant $v"
  rm -rf /dev/shm/ckd*
  env $v timeout 100 $R --repeat 5 --methods raw,checkpointd,checkpointd_noimage --json $OUT/s28a/restore-s28a-${v#CHECKPOINTD_RESTORE_}.json > $OUT/s28a/restore-s28a-${v#CHECKPOINTD_RESTORE_}.log 2>&1
  echo "exit $?"; grep -A8 "^-- /dev/shm" $OUT/s28a/restore-s28a-${v#CHECKPOINTD_RESTORE_}.log | cut -c1-200
  date -u
done
rm -rf /dev/shm/ckd*
cd $OUT && tar czf s28a.tgz s28a && rm -rf s28a
