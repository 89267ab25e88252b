python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L
echo "== NCCL, two GPUs: recycling and the host budget's rings written by each rank's persist process"
CHECKPOINTD_TEST_BACKEND=nccl timeout 200 python3 -m pytest -q tests/test_distributed_recycle.py -p no:cacheprovider --timeout 150 -rf --tb=short > $OUT/dist-nccl-s22h.log 2>&1
echo "rc $?"; tail -6 $OUT/dist-nccl-s22h.log | cut -c1-300
date -u
