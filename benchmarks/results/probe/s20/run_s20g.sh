python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L
timeout 420 python3 benchmarks/bench_stall.py --state-gb 5 --every 60 --ckpts 4 --prefault-gb 20 --methods none,checkpointd,io_only_reuse,checkpointd,checkpointd_device,none --json $OUT/stall-s20g-h100-every60.json 2>&1 | grep -v "^\s*$" | tail -16
date -u
