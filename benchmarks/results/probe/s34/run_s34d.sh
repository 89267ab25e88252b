# Session 34, call d: run_gpu.sh's restore_tmpfs stage with its defaults on the final code.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site
date -u; nvidia-smi -L; nproc
mkdir -p $OUT/s34d
rm -rf /dev/shm/ckd*
echo "== run_gpu.sh restore_tmpfs stage, defaults"
OUT=$OUT/s34d/rungpu WHEELS=/nonexistent STAGES=restore_tmpfs SKIP_DISK=1 BUDGET_S=560 timeout 575 bash benchmarks/run_gpu.sh > $OUT/s34d/rungpu-s34d.log 2>&1
echo "exit $?"; grep -A16 "^-- /dev/shm" $OUT/s34d/rungpu/restore_tmpfs.log | cut -c1-200
python3 - <<'PY' $OUT/s34d/rungpu/restore_tmpfs.json
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["dirs"][0]["rows"]:
    print(f'{r["method"][:50]:50s}', " ".join(f"{t*1e3:.1f}" for t in r.get("times_s", [])), r.get("error", ""))
PY
rm -rf /dev/shm/ckd*
date -u
cd $OUT && tar czf s34d.tgz s34d && rm -rf s34d
