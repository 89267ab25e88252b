python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1
NEW=/tmp/site:$PWD/src OLD=/tmp/site:$PWD/.probe/old/src
date -u; nvidia-smi -L
PYTHONPATH=$NEW timeout 280 python3 -m pytest -q tests/gpu tests/test_persist_process.py tests/test_recycle.py tests/test_host_budget.py tests/test_early_writeback.py tests/test_snapshot.py tests/test_pagemem.py tests/test_fast_restore.py tests/test_arena_pieces.py tests/test_restore_inplace.py -p no:cacheprovider 2>&1 | tail -4
for v in new old; do
  if [ $v = new ]; then P=$NEW; else P=$OLD; fi
  PHASES_FRESH_POOL=1 PYTHONPATH=$P timeout 110 python3 .probe/restore_phases3.py $OUT/phases3-init-$v.json 2>&1 | grep -- "checkpointd from\|---\|copy_pairs\|read_step"
done
date -u
