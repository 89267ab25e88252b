python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1
date -u; nvidia-smi -L; nproc; git log --oneline -1 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD/src
mkdir -p $OUT/s25b
echo "== run_gpu.sh stall stage (main)"
STAGES=stall WHEELS=.whl OUT=$OUT/s25b/rungpu BUDGET_S=330 PREFAULT_GB=20 timeout 350 bash benchmarks/run_gpu.sh > $OUT/s25b/rungpu-s25b.log 2>&1
echo "exit $?"; grep -v "^\[stall\] " $OUT/s25b/rungpu-s25b.log | tail -45 | cut -c1-250
date -u
echo "== 0.45 GB"
timeout 150 python3 benchmarks/bench_stall.py --state-gb 0.5 --every 60 --ckpts 10 --prefault-gb 0 \
  --methods none,checkpointd,checkpointd_device,copy_only,checkpointd,none --dir /dev/shm/ckd-05 --json $OUT/s25b/stall-05gb-s25b.json 2>&1 | grep -v "^\[stall\] " | tail -25 | cut -c1-250
rm -rf /dev/shm/ckd-05 /dev/shm/ckd*
date -u
cd $OUT && tar czf s25b.tgz s25b && rm -rf s25b
