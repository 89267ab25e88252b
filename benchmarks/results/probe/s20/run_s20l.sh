date -u; nvidia-smi -L
STAGES=restore_disk WHEELS=.whl OUT=$OUT/rungpu bash benchmarks/run_gpu.sh 2>&1 | grep -v "^\[restore\]" | tail -24
date -u
