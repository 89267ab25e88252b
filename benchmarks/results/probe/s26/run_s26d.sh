export PYTHONUNBUFFERED=1
date -u; nvidia-smi -L; nproc
mkdir -p $OUT/s26d
echo "== run_gpu.sh persist_tmpfs,restore_tmpfs (main)"
STAGES=persist_tmpfs,restore_tmpfs WHEELS=.whl OUT=$OUT/s26d/rungpu BUDGET_S=470 PREFAULT_GB=0 timeout 500 bash benchmarks/run_gpu.sh > $OUT/s26d/rungpu-s26d.log 2>&1
echo "exit $?"; sed -n '/== persist_tmpfs: /,$p' $OUT/s26d/rungpu-s26d.log | grep -v "^\[" | tail -60 | cut -c1-260
rm -rf /dev/shm/ckd*
date -u
cd $OUT && tar czf s26d.tgz s26d && rm -rf s26d
