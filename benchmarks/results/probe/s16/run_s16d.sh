set -x
date -u
WHEELS=.whl OUT=/tmp/rungpu BUDGET_S=500 bash benchmarks/run_gpu.sh 2>&1 | grep -v "stats()\|construction" | grep -v "^   " | tail -120 | cut -c1-240
cp /tmp/rungpu/*.json $OUT/ 2>/dev/null; ls -la /tmp/rungpu
date -u
