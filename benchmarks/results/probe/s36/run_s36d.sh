# Session 36, call d: run_gpu.sh's stall stage with its defaults on the final code (aa51364).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site
date -u; nvidia-smi -L; nproc; git log --oneline -1 2>/dev/null
mkdir -p $OUT/s36d
rm -rf /dev/shm/ckd*
echo "== run_gpu.sh stall stage, defaults"
OUT=$OUT/s36d/rungpu WHEELS=/nonexistent STAGES=stall SKIP_DISK=1 BUDGET_S=470 timeout 500 bash benchmarks/run_gpu.sh > $OUT/s36d/rungpu-s36d.log 2>&1
echo "exit $?"; sed -n '/################ summary/,$p' $OUT/s36d/rungpu-s36d.log | grep -v "stats()\|construction" | tail -45 | cut -c1-230
rm -rf /dev/shm/ckd*
date -u
cd $OUT && tar czf s36d.tgz s36d && rm -rf s36d
