python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; nproc; git log --oneline -1 2>/dev/null; git status --short | head; python3 -c "import zlib_ng, zstandard; print('zlib_ng ok')"
mkdir -p $OUT/s28e
echo "== tests/gpu/test_restore_cuda.py"
timeout 120 python3 -m pytest -q -p no:cacheprovider -rf --tb=short tests/gpu/test_restore_cuda.py > $OUT/s28e/pytest-restore-s28e.log 2>&1
echo "exit $?"; tail -3 $OUT/s28e/pytest-restore-s28e.log | cut -c1-300
date -u
echo "== cold probe: a resumed job's restore, the pool made beside the read or not (6 rounds)"
rm -rf /dev/shm/ckd*
timeout 240 python3 benchmarks/results/probe/s28/cold_probe.py 6 --json $OUT/s28e/cold-probe-s28e.json > $OUT/s28e/cold-probe-s28e.log 2>&1
echo "exit $?"; tail -4 $OUT/s28e/cold-probe-s28e.log
date -u
echo "== bench_restore tmpfs (repeat 5)"
rm -rf /dev/shm/ckd*
timeout 200 python3 benchmarks/bench_restore.py --state-gb 5 --dirs /dev/shm/ckd-restore --raw-threads 8,max --repeat 5 --methods raw,raw_cold,checkpointd,checkpointd_cold,checkpointd_phases --json $OUT/s28e/restore-s28e.json > $OUT/s28e/restore-s28e.log 2>&1
echo "exit $?"; grep -A14 "^-- /dev/shm" $OUT/s28e/restore-s28e.log | cut -c1-200
rm -rf /dev/shm/ckd*
date -u
cd $OUT && tar czf s28e.tgz s28e && rm -rf s28e
