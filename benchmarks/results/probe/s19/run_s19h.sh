python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site
date -u; nvidia-smi -L; git log --oneline -1
timeout 60 python3 -m pytest -q tests/test_arena_pieces.py -p no:cacheprovider 2>&1 | tail -2
STAGES=persist_disk,restore_disk WHEELS=.whl OUT=$OUT/rungpu timeout 560 bash benchmarks/run_gpu.sh > $OUT/rungpu-h.log 2>&1
echo "rc=$?"; grep -v "^\[persist\]\|^\[restore\]" $OUT/rungpu-h.log | tail -45 | cut -c1-250
date -u
