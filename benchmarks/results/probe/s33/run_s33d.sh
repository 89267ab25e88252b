python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site
date -u; nvidia-smi -L; nproc; git log --oneline -1 2>/dev/null
mkdir -p $OUT/s33d
rm -rf /dev/shm/ckd*
echo "== run_gpu.sh stall_dist stage, defaults (2x H200) (the final code, c20ff70)"
OUT=$OUT/s33d/rungpu WHEELS=/nonexistent STAGES=stall_dist SKIP_DISK=1 BUDGET_S=500 timeout 520 bash benchmarks/run_gpu.sh > $OUT/s33d/rungpu-s33d.log 2>&1
echo "exit $?"; sed -n '/################ summary/,$p' $OUT/s33d/rungpu-s33d.log | grep -v "stats()\|construction" | tail -45 | cut -c1-230
rm -rf /dev/shm/ckd*
date -u
cd $OUT && tar czf s33d.tgz s33d && rm -rf s33d
