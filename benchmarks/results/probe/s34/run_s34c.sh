# Session 34, call c: every CUDA test, then run_gpu.sh's restore_tmpfs stage with its defaults on the final
# code (the native upload now also for copy_pairs' bounce: the host-verified rows).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site
date -u; nvidia-smi -L; nproc
mkdir -p $OUT/s34c
rm -rf /dev/shm/ckd*
echo "== CUDA tests"
PYTHONPATH=/tmp/site:$PWD/src timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu > $OUT/s34c/pytest-s34c.log 2>&1
echo "exit $?"; tail -3 $OUT/s34c/pytest-s34c.log
echo "== run_gpu.sh restore_tmpfs stage, defaults"
OUT=$OUT/s34c/rungpu WHEELS=/nonexistent STAGES=restore_tmpfs SKIP_DISK=1 BUDGET_S=370 timeout 385 bash benchmarks/run_gpu.sh > $OUT/s34c/rungpu-s34c.log 2>&1
echo "exit $?"; grep -A16 "^-- /dev/shm" $OUT/s34c/rungpu/restore_tmpfs.log | cut -c1-200
python3 - <<'PY' $OUT/s34c/rungpu/restore_tmpfs.json
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["dirs"][0]["rows"]:
    print(f'{r["method"][:50]:50s}', " ".join(f"{t*1e3:.1f}" for t in r.get("times_s", [])), r.get("error", ""))
PY
rm -rf /dev/shm/ckd*
date -u
cd $OUT && tar czf s34c.tgz s34c && rm -rf s34c
