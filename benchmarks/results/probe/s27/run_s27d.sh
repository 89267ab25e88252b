export PYTHONUNBUFFERED=1
date -u; nvidia-smi -L; nproc
mkdir -p $OUT/s27d
echo "== run_gpu.sh stall (the defaults)"
rm -rf /dev/shm/ckd*
STAGES=stall WHEELS=.whl OUT=$OUT/s27d/rungpu BUDGET_S=440 PREFAULT_GB=20 timeout 470 bash benchmarks/run_gpu.sh > $OUT/s27d/rungpu-s27d.log 2>&1
echo "exit $?"; sed -n '/################ summary/,$p' $OUT/s27d/rungpu-s27d.log | grep -v "stats()\|construction" | tail -50 | cut -c1-250
rm -rf /dev/shm/ckd*
date -u
cd $OUT && tar czf s27d.tgz s27d && rm -rf s27d
