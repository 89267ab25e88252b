python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L
echo "== every distributed test (gloo, CPU tensors) on a CUDA host"
timeout 420 python3 -m pytest -q tests/test_distributed_*.py -p no:cacheprovider --timeout 150 -rf --tb=line > $OUT/dist-gloo-s22e.log 2>&1
echo "rc $?"; tail -8 $OUT/dist-gloo-s22e.log | cut -c1-300
date -u
