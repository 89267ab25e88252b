date -u; nvidia-smi -L; nproc
STAGES=persist_tmpfs,restore_tmpfs BUDGET_S=540 WHEELS=.whl OUT=$OUT/rungpu bash benchmarks/run_gpu.sh 2>&1 | tail -40 | cut -c1-230
date -u
