python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; nproc; git log --oneline -1 2>/dev/null; git status --short | head; python3 -c "import zlib_ng, zstandard; print('zlib_ng ok')"
mkdir -p $OUT/s29e
echo "== GPU tests (tests/gpu)"
timeout 200 python3 -m pytest -q -p no:cacheprovider -rf --tb=short tests/gpu > $OUT/s29e/pytest-gpu-s29e.log 2>&1
echo "exit $?"; tail -4 $OUT/s29e/pytest-gpu-s29e.log | cut -c1-300
date -u
rm -rf /dev/shm/ckd*
echo "== bench_restore tmpfs (repeat 5, 3 s settle before each manager-based repetition)"
timeout 280 python3 benchmarks/bench_restore.py --state-gb 5 --dirs /dev/shm/ckd-restore --raw-threads 8,max --repeat 5 --methods raw,raw_cold,checkpointd,checkpointd_cold,checkpointd_phases --json $OUT/s29e/restore-s29e.json > $OUT/s29e/restore-s29e.log 2>&1
echo "exit $?"; grep -A14 "^-- /dev/shm" $OUT/s29e/restore-s29e.log | cut -c1-150
python3 - <<'PY' $OUT/s29e/restore-s29e.json
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["dirs"][0]["rows"]:
    print(f'{r["method"][:45]:45s}', " ".join(f"{t*1e3:.1f}" for t in r.get("times_s", [])))
PY
rm -rf /dev/shm/ckd*
date -u
cd $OUT && tar czf s29e.tgz s29e && rm -rf s29e
