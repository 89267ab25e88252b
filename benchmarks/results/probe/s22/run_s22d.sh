python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L
timeout 170 python3 -m pytest -q "tests/test_distributed_recycle.py::test_sharded_saves_write_over_every_ranks_retired_files[auto]" -p no:cacheprovider --timeout 150 -x --tb=long > $OUT/dist-recycle-s22d.log 2>&1
echo "rc $?"; date -u
grep -nE "Error|error|assert|Timeout|deadline|Traceback" $OUT/dist-recycle-s22d.log | head -40 | cut -c1-300
tail -5 $OUT/dist-recycle-s22d.log | cut -c1-300
