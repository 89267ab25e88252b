python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; lscpu | grep -i "model name\|L3"
cc -O3 -std=gnu99 -shared -fPIC .probe/nt.c -o /tmp/libnt.so || exit 1
PF="--prefault-gb 20"
for v in mem nt mem nt; do
  if [ $v = nt ]; then export CHECKPOINTD_PERSIST_NT_LIB=/tmp/libnt.so; else unset CHECKPOINTD_PERSIST_NT_LIB; fi
  echo "== $v $(date -u +%T)"
  timeout 130 python3 benchmarks/bench_stall.py --state-gb 5 --every 60 --ckpts 4 $PF --methods none,io_only_reuse,io_only_reuse,none --json $OUT/stall-s20h-$v-$(date +%s).json 2>&1 | grep "^none\|^io_only\|WARN"
  PF=""
done
date -u
