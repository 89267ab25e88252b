python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1
NEW=/tmp/site:$PWD/src OLD=/tmp/site:$PWD/.probe/old/src
date -u; nvidia-smi -L; nproc
PYTHONPATH=$NEW timeout 100 python3 -m pytest -q tests/test_fast_restore.py tests/gpu/test_restore_cuda.py -p no:cacheprovider 2>&1 | tail -2
for v in new old; do
  if [ $v = new ]; then P=$NEW; else P=$OLD; fi
  PYTHONPATH=$P timeout 120 python3 .probe/restore_phases3.py $OUT/phases3-$v.json 2>&1 | grep -- "checkpointd from\|---\|copy_pairs\|read_step\|crc_pass\|parse"
done
for v in new old; do
  if [ $v = new ]; then P=$NEW; else P=$OLD; fi
  PYTHONPATH=$P timeout 150 python3 benchmarks/bench_restore.py --state-gb 5 --dirs /dev/shm/ckd-restore --repeat 5 --methods raw,checkpointd,checkpointd --json $OUT/restore-$v.json 2>&1 | tail -9
done
date -u
