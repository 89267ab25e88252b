python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; git log --oneline -1; git status --short | head; df -h /tmp /dev/shm | tail -2
timeout 150 python3 benchmarks/bench_restore.py --state-gb 5 --dirs /dev/shm/ckd-restore --repeat 5 --methods raw,checkpointd,checkpointd_nomirror,checkpointd --json $OUT/restore-s19d.json 2>&1 | tail -14
date -u
timeout 280 python3 -m pytest -q tests/gpu tests/test_restore_mirror.py tests/test_persist_process.py tests/test_recycle.py tests/test_host_budget.py tests/test_early_writeback.py tests/test_snapshot.py tests/test_pagemem.py tests/test_fast_restore.py tests/test_arena_pieces.py -p no:cacheprovider 2>&1 | tail -6
date -u
