set -x
date -u
WHEELS=.whl OUT=$OUT/rungpu BUDGET_S=540 bash benchmarks/run_gpu.sh 2>&1 | grep -v "stats()\|construction" | tail -150 | cut -c1-240
date -u
