python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1
NEW=/tmp/site:$PWD/src OLD=/tmp/site:$PWD/.probe/old/src
date -u; nvidia-smi -L
PYTHONPATH=$NEW timeout 120 python3 -m pytest -q tests/gpu/test_restore_cuda.py tests/test_restore_inplace.py tests/test_fast_restore.py -p no:cacheprovider 2>&1 | tail -2
PYTHONPATH=$NEW timeout 90 python3 .probe/cold_restore.py save
for i in 1 2 3 4; do
  for v in new old; do
    if [ $v = new ]; then P=$NEW; else P=$OLD; fi
    echo -n "$v "; PYTHONPATH=$P timeout 90 python3 .probe/cold_restore.py restore | tee -a $OUT/cold-s20j-$v.jsonl
  done
done
rm -rf /dev/shm/ckd-cold
date -u
