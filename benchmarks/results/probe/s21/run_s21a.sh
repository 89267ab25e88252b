python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; uname -r; grep -E ' /dev/shm ' /proc/mounts; cat /sys/kernel/mm/transparent_hugepage/shmem_enabled /sys/kernel/mm/lru_gen/enabled 2>&1
timeout 200 python3 benchmarks/bench_restore.py --state-gb 5 --dirs /dev/shm/ckd-restore --repeat 4 --raw-threads 16 --methods raw_cold,raw,checkpointd,checkpointd_cold --json $OUT/restore-cold-s21a.json 2>&1 | tail -9
timeout 280 python3 -m pytest -q tests/gpu tests/test_persist_process.py tests/test_recycle.py tests/test_host_budget.py tests/test_early_writeback.py tests/test_snapshot.py tests/test_pagemem.py tests/test_fast_restore.py tests/test_arena_pieces.py tests/test_restore_inplace.py -p no:cacheprovider 2>&1 | tail -3
date -u
