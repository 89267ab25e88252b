python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L
timeout 120 python3 -m pytest -q tests/test_pagemem.py tests/test_fast_restore.py tests/gpu/test_restore_cuda.py -p no:cacheprovider 2>&1 | tail -2
timeout 150 python3 .probe/restore_phases2.py $OUT/phases2-s19l.json 2>&1 | grep -- "---\|prepare_async\|drop_later\|copy_pairs\|read_step"
timeout 150 python3 benchmarks/bench_restore.py --state-gb 5 --dirs /dev/shm/ckd-restore --repeat 5 --methods raw,checkpointd,checkpointd --json $OUT/restore-s19l.json 2>&1 | tail -9
date -u
