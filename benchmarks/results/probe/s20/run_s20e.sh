python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; which cc gcc
cc -O3 -std=gnu99 -shared -fPIC .probe/nt.c -o /tmp/libnt.so && ls -la /tmp/libnt.so
for v in mem nt mem nt; do
  if [ $v = nt ]; then export CHECKPOINTD_PERSIST_NT_LIB=/tmp/libnt.so; else unset CHECKPOINTD_PERSIST_NT_LIB; fi
  echo "== $v $(date -u +%T)"
  timeout 140 python3 benchmarks/bench_stall.py --D 1024 --L 24 --B 1 --S 128 --every 50 --ckpts 4 --prefault-gb 12 --methods none,io_only_reuse,io_only_reuse,none --json $OUT/stall-cpubound-$v-$(date +%s).json 2>&1 | grep -v "^\s*$" | tail -14
done
date -u
