# Session 34, call a: the CUDA tests (native upload included), then the restore with timelines: the
# native upload (the default now) against the Python bounce (checkpointd_pyupload), 5 repetitions each.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; nproc; which cc gcc
mkdir -p $OUT/s34a
rm -rf /dev/shm/ckd*
echo "== CUDA tests"
timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_device_verify_cuda.py tests/gpu/test_restore_cuda.py > $OUT/s34a/gpu-tests-s34a.log 2>&1
echo "exit $?"; tail -5 $OUT/s34a/gpu-tests-s34a.log
echo "== bench_restore tmpfs with timelines: native upload vs the Python bounce"
timeout 300 python3 benchmarks/results/probe/s34/bench_timeline.py --state-gb 5 --dirs /dev/shm/ckd-bench/restore --raw-threads 8,max --repeat 5 --methods raw,checkpointd,checkpointd_pyupload --json $OUT/s34a/restore-s34a.json > $OUT/s34a/restore-s34a.log 2>&1
echo "exit $?"; grep -E "^\[timeline\]|^\[restore\]" $OUT/s34a/restore-s34a.log | cut -c1-150
grep -A12 "^-- /dev/shm" $OUT/s34a/restore-s34a.log | cut -c1-170
python3 - <<'PY' $OUT/s34a/restore-s34a.json
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["dirs"][0]["rows"]:
    print(f'{r["method"][:50]:50s}', " ".join(f"{t*1e3:.1f}" for t in r.get("times_s", [])), r.get("error", ""))
PY
rm -rf /dev/shm/ckd*
date -u
cd $OUT && tar czf s34a.tgz s34a && rm -rf s34a
