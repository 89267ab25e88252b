set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L
D=checkpointd_device
timeout 560 python3 benchmarks/bench_stall.py --state-gb 5 --methods none,clone_only,io_only_reuse,$D,$D@CHECKPOINTD_PERSIST_THREADS=4,$D@CHECKPOINTD_PERSIST_THREADS=8,clone_only,io_only_reuse,$D,$D@CHECKPOINTD_PERSIST_THREADS=4,$D@CHECKPOINTD_PERSIST_THREADS=8,none --dir /dev/shm/ckd --json $OUT/stall-s15b-5gb-device.json 2>&1 | grep -v "stats()\|construction" | tail -16 | cut -c1-200
date -u
