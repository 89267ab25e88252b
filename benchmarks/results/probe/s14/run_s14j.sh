set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; python3 -c "from checkpointd import crc; print('crc', crc.CRC32_IMPLEMENTATION)"
timeout 250 python3 benchmarks/bench_stall.py --state-gb 5 --dir /dev/shm/ckd-bench/stall --json $OUT/stall-s14j-5gb-default.json 2>&1 | grep -v "stats()\|construction" | tail -14 | cut -c1-240
date -u
timeout 90 python3 benchmarks/bench_restore.py --state-gb 5 --repeat 3 --raw-threads 16 --dirs /dev/shm/ckd-restore --methods raw,checkpointd,checkpointd_zstd --json $OUT/restore-s14j.json 2>&1 | grep -E "raw read|restore_latest " | tail -4
date -u
