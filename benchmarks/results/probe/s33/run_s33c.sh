python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; nproc; git log --oneline -1 2>/dev/null
mkdir -p $OUT/s33c
rm -rf /dev/shm/ckd*
echo "== bench_restore tmpfs (run_gpu.sh's arguments, repeat 6) with each warm restore's timeline (session 31's probe)"
timeout 400 python3 benchmarks/results/probe/s31/bench_timeline.py --state-gb 5 --dirs /dev/shm/ckd-bench/restore --raw-threads 8,max --repeat 6 --methods raw,torch_load,checkpointd,checkpointd_hostverify --json $OUT/s33c/restore-s33c.json > $OUT/s33c/restore-s33c.log 2>&1
echo "exit $?"; grep -E "^\[timeline\]|^\[restore\]" $OUT/s33c/restore-s33c.log | cut -c1-150
grep -A12 "^-- /dev/shm" $OUT/s33c/restore-s33c.log | cut -c1-170
python3 - <<'PY' $OUT/s33c/restore-s33c.json
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["dirs"][0]["rows"]:
    print(f'{r["method"][:50]:50s}', " ".join(f"{t*1e3:.1f}" for t in r.get("times_s", [])), r.get("error", ""))
PY
rm -rf /dev/shm/ckd*
date -u
cd $OUT && tar czf s33c.tgz s33c && rm -rf s33c
