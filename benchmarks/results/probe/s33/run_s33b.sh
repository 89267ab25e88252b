python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site
date -u; nvidia-smi -L; nproc; git log --oneline -1 2>/dev/null
mkdir -p $OUT/s33b
rm -rf /dev/shm/ckd*
echo "== run_gpu.sh restore_tmpfs, compression, persist_disk (2 rounds), restore_disk stages, defaults (the final code, c20ff70)"
OUT=$OUT/s33b/rungpu WHEELS=/nonexistent STAGES=restore_tmpfs,compression,persist_disk,restore_disk DISK_ROUNDS=2 PREFAULT_GB=0 BUDGET_S=565 timeout 575 bash benchmarks/run_gpu.sh > $OUT/s33b/rungpu-s33b.log 2>&1
echo "exit $?"; sed -n '/################ summary/,$p' $OUT/s33b/rungpu-s33b.log | grep -v "stats()\|construction" | tail -70 | cut -c1-230
rm -rf /dev/shm/ckd*
date -u
cd $OUT && tar czf s33b.tgz s33b && rm -rf s33b
