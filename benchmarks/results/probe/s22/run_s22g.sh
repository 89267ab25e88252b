python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L
echo "== the whole test suite on a CUDA host (no S3 server, no PhysicsNeMo here)"
timeout 540 python3 -m pytest -q tests -p no:cacheprovider --timeout 200 -rf --tb=short > $OUT/full-suite-s22g.log 2>&1
echo "rc $?"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/full-suite-s22g.log | tail -25 | cut -c1-300
date -u
