export PYTHONUNBUFFERED=1
date -u; nvidia-smi -L; nproc
mkdir -p $OUT/s26c
echo "== run_gpu.sh stall stage (main + the interleaved default)"
STAGES=stall WHEELS=.whl OUT=$OUT/s26c/rungpu BUDGET_S=480 PREFAULT_GB=20 timeout 500 bash benchmarks/run_gpu.sh > $OUT/s26c/rungpu-s26c.log 2>&1
echo "exit $?"; grep -v "^\[stall\] " $OUT/s26c/rungpu-s26c.log | grep -v "stats()" | tail -50 | cut -c1-280
rm -rf /dev/shm/ckd*
date -u
cd $OUT && tar czf s26c.tgz s26c && rm -rf s26c
