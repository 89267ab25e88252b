python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; git log --oneline -1
timeout 100 python3 -m pytest -q -x tests/gpu/test_restore_cuda.py -k "mirror" -p no:cacheprovider --tb=short 2>&1 | tail -40
date -u
timeout 200 python3 .probe/restore_phases.py $OUT/phases-s19e.json 16,8 2>&1 | tail -150
date -u
