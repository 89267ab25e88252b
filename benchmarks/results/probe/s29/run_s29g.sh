python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; nproc; git log --oneline -1 2>/dev/null; git status --short | head; python3 -c "import zlib_ng, zstandard, triton; print('zlib_ng ok, triton', triton.__version__)"
mkdir -p $OUT/s29g
echo "== GPU tests: device verification and the CUDA restores"
timeout 150 python3 -m pytest -q -p no:cacheprovider -rf --tb=short tests/gpu/test_device_verify_cuda.py tests/gpu/test_restore_cuda.py > $OUT/s29g/pytest-s29g.log 2>&1
echo "exit $?"; grep -E "passed|failed|Error|error" $OUT/s29g/pytest-s29g.log | tail -8 | cut -c1-300
date -u
echo "== Triton's first use in fresh processes (cold cache, then warm)"
export TRITON_CACHE_DIR=/tmp/tcache; rm -rf $TRITON_CACHE_DIR
for i in cold warm1 warm2; do echo -n "$i "; timeout 60 python3 benchmarks/results/probe/s29/triton_first_use.py 2>&1 | tail -1; done | tee $OUT/s29g/triton-first-use-s29g.log
unset TRITON_CACHE_DIR
rm -rf /dev/shm/ckd*
echo "== bench_restore tmpfs (repeat 5): device-verified (default) and host-verified"
timeout 330 python3 benchmarks/bench_restore.py --state-gb 5 --dirs /dev/shm/ckd-restore --raw-threads 8,max --repeat 5 --methods raw,raw_cold,checkpointd,checkpointd_hostverify,checkpointd_cold,checkpointd_phases --json $OUT/s29g/restore-s29g.json > $OUT/s29g/restore-s29g.log 2>&1
echo "exit $?"; grep -A15 "^-- /dev/shm" $OUT/s29g/restore-s29g.log | cut -c1-150
python3 - <<'PY' $OUT/s29g/restore-s29g.json
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["dirs"][0]["rows"]:
    print(f'{r["method"][:45]:45s}', " ".join(f"{t*1e3:.1f}" for t in r.get("times_s", [])), r.get("error", ""))
PY
rm -rf /dev/shm/ckd*
date -u
cd $OUT && tar czf s29g.tgz s29g && rm -rf s29g
