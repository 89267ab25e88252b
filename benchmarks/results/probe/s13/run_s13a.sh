set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; nproc
for L in 33 3; do
timeout 90 python3 .probe/call_phases.py --d 256 --layers $L --saves 12 --json $OUT/call-pinned-L$L.json 2>&1 | grep "^{" | cut -c1-900
timeout 90 python3 .probe/call_phases.py --d 256 --layers $L --saves 12 --device-staging --json $OUT/call-device-L$L.json 2>&1 | grep "^{" | cut -c1-900
done
timeout 90 python3 .probe/call_phases.py --d 256 --layers 33 --saves 6 --device-staging --profile 2>&1 | tail -32 | cut -c1-160
date -u
timeout 300 python3 -m pytest -q -x tests/gpu tests/test_persist_process.py tests/test_recycle.py tests/test_host_budget.py tests/test_early_writeback.py tests/test_snapshot.py -p no:cacheprovider 2>&1 | tail -3
date -u
