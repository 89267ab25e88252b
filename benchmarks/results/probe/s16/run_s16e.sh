set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L
timeout 400 python3 benchmarks/bench_stall.py --state-gb 5 --prefault-gb 40 --dir /dev/shm/ckd-bench/stall --methods none,checkpointd_zstd,checkpointd_zstd@CHECKPOINTD_COMPRESS_NICE=0,checkpointd_zstd,checkpointd_zstd@CHECKPOINTD_COMPRESS_NICE=0,none --json $OUT/stall-s16e-zstd-nice.json 2>&1 | grep -v "stats()\|construction" | grep -v "^   " | tail -14 | cut -c1-230
date -u
