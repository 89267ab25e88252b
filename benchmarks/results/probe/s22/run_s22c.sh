python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L
echo "== hurry with the real cudaHostRegister"
timeout 120 python3 -m pytest -q tests/gpu/test_cuda_paths.py -k "registration_pauses" -p no:cacheprovider --tb=short 2>&1 | tail -15
date -u
echo "== distributed recycle (gloo, CPU tensors, on a CUDA host)"
timeout 200 python3 -m pytest -q tests/test_distributed_recycle.py -p no:cacheprovider --timeout 90 -rf --tb=short 2>&1 | tail -30 | cut -c1-300
date -u
echo "== the CUDA suite"
timeout 280 python3 -m pytest -q tests/gpu tests/test_persist_process.py tests/test_recycle.py tests/test_host_budget.py tests/test_early_writeback.py tests/test_snapshot.py tests/test_pagemem.py tests/test_fast_restore.py tests/test_arena_pieces.py tests/test_restore_inplace.py -p no:cacheprovider --timeout 120 -rf --tb=line 2>&1 | tail -12 | cut -c1-300
date -u
