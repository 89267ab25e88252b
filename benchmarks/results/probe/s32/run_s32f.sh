python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L
mkdir -p $OUT/s32f
echo "== the GPU tests on the final code (tests/gpu: CUDA save paths, host budget, device verification, CUDA restores) and the mount-table test"
timeout 230 python3 -m pytest -q -p no:cacheprovider -rf --tb=short tests/gpu tests/test_write_modes.py > $OUT/s32f/pytest-s32f.log 2>&1
echo "exit $?"; grep -E "FAILED|ERROR|passed|failed" $OUT/s32f/pytest-s32f.log | tail -8 | cut -c1-200
date -u
cd $OUT && tar czf s32f.tgz s32f && rm -rf s32f
