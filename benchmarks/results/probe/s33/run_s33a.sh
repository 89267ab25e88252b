python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site
date -u; nvidia-smi -L; nproc; git log --oneline -1 2>/dev/null
mkdir -p $OUT/s33a
rm -rf /dev/shm/ckd*
echo "== run_gpu.sh stall + persist_tmpfs stages, defaults (the final code, c20ff70)"
OUT=$OUT/s33a/rungpu WHEELS=/nonexistent STAGES=stall,persist_tmpfs SKIP_DISK=1 BUDGET_S=560 timeout 575 bash benchmarks/run_gpu.sh > $OUT/s33a/rungpu-s33a.log 2>&1
echo "exit $?"; sed -n '/################ summary/,$p' $OUT/s33a/rungpu-s33a.log | grep -v "stats()\|construction" | tail -70 | cut -c1-230
rm -rf /dev/shm/ckd*
date -u
cd $OUT && tar czf s33a.tgz s33a && rm -rf s33a
