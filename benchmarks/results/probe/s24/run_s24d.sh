python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1
mkdir -p $OUT/d
date -u; nvidia-smi -L; nproc
echo "== restore: a resumed job's (fresh process) with 3ec8e19"
PYTHONPATH=/tmp/site:$PWD/src timeout 150 python3 benchmarks/bench_restore.py --state-gb 5 --dirs /dev/shm/ckd-r --methods raw_cold,checkpointd_cold --raw-threads max --repeat 3 --json $OUT/d/restore-cold-s24d.json 2>&1 | grep -E "^raw|^checkpointd|rror" | cut -c1-170
rm -rf /dev/shm/ckd-r
date -u
echo "== run_gpu.sh persist_disk (2 rounds)"
STAGES=persist_disk DISK_ROUNDS=2 WHEELS=.whl OUT=$OUT/d/rungpu BUDGET_S=200 PREFAULT_GB=0 timeout 215 bash benchmarks/run_gpu.sh > $OUT/d/rungpu-d.log 2>&1
echo "exit $?"; grep -B2 -A16 "^-- /var" $OUT/d/rungpu-d.log | tail -18 | cut -c1-200
date -u
cd $OUT && tar czf d.tgz d && rm -rf d
