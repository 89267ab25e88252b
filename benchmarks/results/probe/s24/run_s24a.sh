python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1
date -u; nvidia-smi -L; nproc; git log --oneline -1 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD/src
echo "== host budget 25 % (main)"
timeout 110 python3 benchmarks/bench_stall.py --state-gb 5 --every 100 --ckpts 3 --dir /dev/shm/ckd-h25 --prefault-gb 20 --methods none,checkpointd_host25 --json $OUT/host25-s24a.json 2>&1 | grep -E "^none|^checkpointd|rror|WARN" | cut -c1-220
rm -rf /dev/shm/ckd-h25
date -u
echo "== run_gpu.sh stall,persist_tmpfs,restore_tmpfs"
STAGES=stall,persist_tmpfs,restore_tmpfs WHEELS=.whl OUT=$OUT/rungpu BUDGET_S=440 PREFAULT_GB=0 timeout 470 bash benchmarks/run_gpu.sh > $OUT/rungpu-a.log 2>&1
echo "exit $?"; tail -60 $OUT/rungpu-a.log | cut -c1-250
date -u
