# Session 34, call b: run_gpu.sh's restore_tmpfs stage with its defaults on the final code (native upload).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site
date -u; nvidia-smi -L; nproc; git log --oneline -1 2>/dev/null
mkdir -p $OUT/s34b
rm -rf /dev/shm/ckd*
echo "== run_gpu.sh restore_tmpfs stage, defaults"
OUT=$OUT/s34b/rungpu WHEELS=/nonexistent STAGES=restore_tmpfs SKIP_DISK=1 BUDGET_S=560 timeout 575 bash benchmarks/run_gpu.sh > $OUT/s34b/rungpu-s34b.log 2>&1
echo "exit $?"; grep -A16 "^-- /dev/shm" $OUT/s34b/rungpu/restore_tmpfs.log | cut -c1-200
python3 - <<'PY' $OUT/s34b/rungpu/restore_tmpfs.json
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["dirs"][0]["rows"]:
    print(f'{r["method"][:50]:50s}', " ".join(f"{t*1e3:.1f}" for t in r.get("times_s", [])), r.get("error", ""))
PY
rm -rf /dev/shm/ckd*
date -u
cd $OUT && tar czf s34b.tgz s34b && rm -rf s34b
