python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; git log --oneline -1 2>/dev/null; git status --short | head
mkdir -p $OUT/s30d
echo "== GPU tests on the final code: device verification and the CUDA restores"
timeout 110 python3 -m pytest -v -p no:cacheprovider -rf --tb=short tests/gpu/test_device_verify_cuda.py tests/gpu/test_restore_cuda.py > $OUT/s30d/pytest-s30d.log 2>&1
echo "exit $?"; grep -E "FAILED|ERROR|passed|failed" $OUT/s30d/pytest-s30d.log | tail -8 | cut -c1-200
date -u
cd $OUT && tar czf s30d.tgz s30d && rm -rf s30d
