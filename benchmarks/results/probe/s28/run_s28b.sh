python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; nproc; git log --oneline -1 2>/dev/null; python3 -c "import zlib_ng, zstandard; print('zlib_ng ok')"
mkdir -p $OUT/s28b
echo "== tests/gpu/test_restore_cuda.py"
timeout 150 python3 -m pytest -q -p no:cacheprovider -rf --tb=short tests/gpu/test_restore_cuda.py > $OUT/s28b/pytest-restore-s28b.log 2>&1
echo "exit $?"; tail -40 $OUT/s28b/pytest-restore-s28b.log | cut -c1-300
date -u
echo "== image probe (restore_latest, fresh manager each, 5 variants rotated, 10 rounds)"
rm -rf /dev/shm/ckd*
timeout 300 python3 benchmarks/results/probe/s28/image_probe.py 10 --json $OUT/s28b/image-probe-s28b.json > $OUT/s28b/image-probe-s28b.log 2>&1
echo "exit $?"; tail -14 $OUT/s28b/image-probe-s28b.log
rm -rf /dev/shm/ckd*
date -u
cd $OUT && tar czf s28b.tgz s28b && rm -rf s28b
