set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; nproc; uname -r
M=none,checkpointd_device,io_only_reuse,checkpointd_device@CHECKPOINTD_PERSIST_THREADS=4,checkpointd_device,io_only_reuse,checkpointd_device@CHECKPOINTD_PERSIST_THREADS=4,none
timeout 500 python3 benchmarks/bench_stall.py --state-gb 5 --every 60 --ckpts 8 --step-counters --methods $M --dir /dev/shm/ckd-bench/stall --json $OUT/stall-s17a-counters.json 2>&1 | grep -v "stats()\|construction" | grep -v "^\[stall\] [a-z_#@=A-Z0-9]*: {" | tail -40 | cut -c1-400
date -u
