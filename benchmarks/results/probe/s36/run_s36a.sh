# Session 36, call a: every CUDA test on the code that landed with stop 41 (session 34's native upload
# after its last GPU run: 18335a6, 496e3c9, dc05b5d, f86c83a), then run_gpu.sh's restore_tmpfs stage (3
# repetitions), then 0.45 GB: checkpointd and device staging beside the bare copy and device staging's copies.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site
date -u; nvidia-smi -L; nproc; git log --oneline -1 2>/dev/null
mkdir -p $OUT/s36a
rm -rf /dev/shm/ckd*
echo "== CUDA tests"
PYTHONPATH=/tmp/site:$PWD/src timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu > $OUT/s36a/pytest-s36a.log 2>&1
echo "exit $?"; tail -3 $OUT/s36a/pytest-s36a.log; grep -E "FAILED|ERROR" $OUT/s36a/pytest-s36a.log | head
date -u
echo "== run_gpu.sh restore_tmpfs stage, 3 repetitions"
OUT=$OUT/s36a/rungpu WHEELS=/nonexistent STAGES=restore_tmpfs SKIP_DISK=1 RESTORE_REPEAT=3 BUDGET_S=290 timeout 300 bash benchmarks/run_gpu.sh > $OUT/s36a/rungpu-s36a.log 2>&1
echo "exit $?"; grep -A16 "^-- /dev/shm" $OUT/s36a/rungpu/restore_tmpfs.log | cut -c1-200
rm -rf /dev/shm/ckd*
date -u
echo "== 0.45 GB stall"
PYTHONPATH=/tmp/site:$PWD/src timeout 150 python3 benchmarks/bench_stall.py --state-gb 0.5 --every 60 --ckpts 8 --dir /dev/shm/ckd-bench/stall --methods none,checkpointd,copy_only,checkpointd_device,clone_only,none --json $OUT/s36a/stall-05gb-s36a.json > $OUT/s36a/stall-05gb-s36a.log 2>&1
echo "exit $?"; grep -B2 -A14 "stall ms" $OUT/s36a/stall-05gb-s36a.log | cut -c1-220 | tail -30
rm -rf /dev/shm/ckd*
date -u
cd $OUT && tar czf s36a.tgz s36a && rm -rf s36a
