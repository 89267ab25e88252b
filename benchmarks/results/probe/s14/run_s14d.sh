set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1
date -u
for v in src .probe/s8/src src .probe/s8/src; do
PYTHONPATH=/tmp/site:$PWD/$v timeout 100 python3 benchmarks/bench_restore.py --state-gb 5 --repeat 3 --raw-threads 16 --dirs /dev/shm/ckd-restore --methods raw,checkpointd 2>&1 | grep -E "raw read|restore_latest " | tail -3
done
date -u
PYTHONPATH=/tmp/site:$PWD/src timeout 100 python3 .probe/restore_prof.py 5 2>&1 | cut -c1-200 | head -75
date -u
