python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; git log --oneline -1 2>/dev/null; git status --short | head -12
mkdir -p $OUT/s29h
echo "== GPU tests: device verification (opt-in) and the CUDA restores"
timeout 120 python3 -m pytest -q -p no:cacheprovider -rf --tb=short tests/gpu/test_device_verify_cuda.py tests/gpu/test_restore_cuda.py > $OUT/s29h/pytest-s29h.log 2>&1
echo "exit $?"; grep -E "passed|failed|Error" $OUT/s29h/pytest-s29h.log | tail -6 | cut -c1-300
rm -rf /dev/shm/ckd*
echo "== bench_restore tmpfs (repeat 4): host-verified (default) and device-verified"
timeout 150 python3 benchmarks/bench_restore.py --state-gb 5 --dirs /dev/shm/ckd-restore --raw-threads max --repeat 4 --methods raw,checkpointd,checkpointd_deviceverify --json $OUT/s29h/restore-s29h.json > $OUT/s29h/restore-s29h.log 2>&1
echo "exit $?"; grep -A7 "^-- /dev/shm" $OUT/s29h/restore-s29h.log | cut -c1-150
python3 - <<'PY' $OUT/s29h/restore-s29h.json
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["dirs"][0]["rows"]:
    print(f'{r["method"][:45]:45s}', " ".join(f"{t*1e3:.1f}" for t in r.get("times_s", [])), r.get("error", ""))
PY
rm -rf /dev/shm/ckd*
date -u
cd $OUT && tar czf s29h.tgz s29h && rm -rf s29h
