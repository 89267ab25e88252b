# Session 34, call c: every CUDA test, then the host-verified restore (copy_pairs' bounce) with timelines,
# native upload against the Python bounce (CHECKPOINTD_RESTORE_UPLOAD=python for the whole second run).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; nproc
mkdir -p $OUT/s34c
rm -rf /dev/shm/ckd*
echo "== CUDA tests"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu > $OUT/s34c/pytest-s34c.log 2>&1
echo "exit $?"; tail -3 $OUT/s34c/pytest-s34c.log
for up in native python; do
  echo "== bench_restore tmpfs with timelines, CHECKPOINTD_RESTORE_UPLOAD=$up"
  CHECKPOINTD_RESTORE_UPLOAD=$up timeout 150 python3 benchmarks/results/probe/s34/bench_timeline.py --state-gb 5 --dirs /dev/shm/ckd-bench/restore --raw-threads max --repeat 4 --methods raw,checkpointd_hostverify,checkpointd --json $OUT/s34c/restore-$up-s34c.json > $OUT/s34c/restore-$up-s34c.log 2>&1
  echo "exit $?"; grep -A6 "^-- /dev/shm" $OUT/s34c/restore-$up-s34c.log | cut -c1-140
  python3 - <<'PY' $OUT/s34c/restore-$up-s34c.json
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["dirs"][0]["rows"]:
    print(f'{r["method"][:50]:50s}', " ".join(f"{t*1e3:.1f}" for t in r.get("times_s", [])), r.get("error", ""))
PY
  rm -rf /dev/shm/ckd*
done
date -u
cd $OUT && tar czf s34c.tgz s34c && rm -rf s34c
