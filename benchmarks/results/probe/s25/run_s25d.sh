python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1
date -u; nvidia-smi -L; nproc; git log --oneline -1 2>/dev/null; df -h /tmp /root 2>/dev/null | tail -2
export PYTHONPATH=/tmp/site:$PWD/src
mkdir -p $OUT/s25d
echo "== run_gpu.sh restore_disk"
STAGES=restore_disk WHEELS=.whl OUT=$OUT/s25d/rd BUDGET_S=240 PREFAULT_GB=0 timeout 255 bash benchmarks/run_gpu.sh > $OUT/s25d/rungpu-restore_disk-s25d.log 2>&1
echo "exit $?"; grep -v "^\[" $OUT/s25d/rungpu-restore_disk-s25d.log | tail -22 | cut -c1-230
date -u
echo "== run_gpu.sh persist_disk (raw, checkpointd, checkpointd_recycle; 2 rounds)"
STAGES=persist_disk PERSIST_METHODS=raw,checkpointd,checkpointd_recycle DISK_ROUNDS=2 WHEELS=.whl OUT=$OUT/s25d/pd BUDGET_S=215 PREFAULT_GB=0 timeout 230 bash benchmarks/run_gpu.sh > $OUT/s25d/rungpu-persist_disk-s25d.log 2>&1
echo "exit $?"; grep -v "^\[" $OUT/s25d/rungpu-persist_disk-s25d.log | tail -22 | cut -c1-230
date -u
cd $OUT && tar czf s25d.tgz s25d && rm -rf s25d
