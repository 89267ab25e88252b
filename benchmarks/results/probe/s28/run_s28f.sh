python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; git log --oneline -1 2>/dev/null; git status --short | head -5
mkdir -p $OUT/s28f
echo "== tests/gpu/test_restore_cuda.py"
timeout 100 python3 -m pytest -q -p no:cacheprovider -rf --tb=short tests/gpu/test_restore_cuda.py > $OUT/s28f/pytest-restore-s28f.log 2>&1
echo "exit $?"; tail -3 $OUT/s28f/pytest-restore-s28f.log | cut -c1-300
date -u
cd $OUT && tar czf s28f.tgz s28f && rm -rf s28f
