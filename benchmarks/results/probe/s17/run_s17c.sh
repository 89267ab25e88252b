set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; nproc; git log --oneline -1 2>/dev/null
timeout 200 python3 -m pytest -q tests/gpu tests/test_persist_process.py tests/test_recycle.py tests/test_host_budget.py tests/test_early_writeback.py tests/test_snapshot.py -p no:cacheprovider 2>&1 | tail -4
date -u
D=checkpointd_device; K=@CHECKPOINTD_KEEP_MAPPINGS=0; R=io_only_reuse
M=none,$D,$D$K,$R,$R$K,checkpointd,$D,$D$K,none
timeout 330 python3 benchmarks/bench_stall.py --state-gb 5 --every 60 --ckpts 8 --step-counters --methods $M --dir /dev/shm/ckd-bench/stall --json $OUT/stall-s17c-keep.json 2>&1 | grep -v "stats()\|construction" | grep -v "^\[stall\] [a-z_#@=A-Z0-9]*: {" | grep -v "^   [a-z_#@=A-Z0-9]*: [0-9]* steps >" | tail -14 | cut -c1-330
date -u
