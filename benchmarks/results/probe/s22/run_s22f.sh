python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L
echo "== every distributed test (gloo, CPU tensors) on a CUDA host"
timeout 300 python3 -m pytest -q tests/test_distributed_*.py -p no:cacheprovider --timeout 150 -rf --tb=short > $OUT/dist-gloo-s22f.log 2>&1
echo "rc $?"; tail -6 $OUT/dist-gloo-s22f.log | cut -c1-300
date -u
echo "== the CUDA suite"
timeout 270 python3 -m pytest -q tests/gpu tests/test_persist_process.py tests/test_recycle.py tests/test_host_budget.py tests/test_early_writeback.py tests/test_snapshot.py tests/test_pagemem.py tests/test_fast_restore.py tests/test_arena_pieces.py tests/test_restore_inplace.py -p no:cacheprovider --timeout 120 -rf --tb=short > $OUT/cuda-suite-s22f.log 2>&1
echo "rc $?"; tail -4 $OUT/cuda-suite-s22f.log | cut -c1-300
date -u
