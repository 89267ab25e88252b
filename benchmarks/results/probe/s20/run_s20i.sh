python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L
timeout 90 python3 .probe/cold_restore.py save
for i in 1 2 3 4; do timeout 90 python3 .probe/cold_restore.py restore | tee -a $OUT/cold-s20i.jsonl; done
rm -rf /dev/shm/ckd-cold
date -u
