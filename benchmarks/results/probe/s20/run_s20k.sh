date -u; nvidia-smi -L
STAGES=restore_tmpfs WHEELS=.whl OUT=$OUT/rungpu bash benchmarks/run_gpu.sh 2>&1 | tail -22
date -u
