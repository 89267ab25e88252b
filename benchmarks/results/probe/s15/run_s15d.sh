set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; python3 -c "from checkpointd import crc; print('crc', crc.CRC32_IMPLEMENTATION)"
timeout 290 python3 benchmarks/bench_stall.py --state-gb 5 --dir /dev/shm/ckd-bench/stall --json $OUT/stall-s15d-5gb-default.json 2>&1 | grep -v "stats()\|construction" | grep -v "^   " | tail -14 | cut -c1-200
date -u
timeout 80 python3 benchmarks/bench_restore.py --state-gb 5 --repeat 3 --raw-threads 16 --dirs /dev/shm/ckd-restore --methods raw,checkpointd,checkpointd_zstd --json $OUT/restore-s15d.json 2>&1 | grep -E "prefault|raw read|restore_latest " | tail -5
date -u
timeout 160 python3 benchmarks/bench_stall.py --state-gb 0.5 --dir /dev/shm/ckd-bench/stall05 --methods none,checkpointd,checkpointd_device,copy_only,dcp_async,torch_save,checkpointd,none --json $OUT/stall-s15d-05gb.json 2>&1 | grep -v "stats()\|construction" | grep -v "^   " | tail -12 | cut -c1-200
date -u
