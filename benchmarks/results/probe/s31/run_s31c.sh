python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; nproc; python3 -c "import zlib_ng, zstandard, torch; print('zlib_ng ok, torch', torch.__version__, torch.version.cuda)"
mkdir -p $OUT/s31c
P=benchmarks/results/probe/s31
echo "== GPU tests: device verification and the CUDA restores"
timeout 100 python3 -m pytest -v -p no:cacheprovider -rf --tb=short --durations=5 tests/gpu/test_device_verify_cuda.py tests/gpu/test_restore_cuda.py > $OUT/s31c/pytest-s31c.log 2>&1
echo "exit $?"; grep -E "FAILED|ERROR|passed|failed|Error" $OUT/s31c/pytest-s31c.log | tail -20 | cut -c1-200
date -u
echo "== A/B: old, new, host warm x4; fresh processes old/new x3 each"
PROBE_MODES=old,new,host PROFILE=0 timeout 200 python3 $P/restore_ab.py 4 3 --json $OUT/s31c/ab-s31c.json > $OUT/s31c/ab-s31c.log 2>&1
echo "exit $?"; grep -E "^round|^cold|^  (old|new|host|cold)" $OUT/s31c/ab-s31c.log | cut -c1-150
grep -A30 "^cold 5" $OUT/s31c/ab-s31c.log | cut -c1-150
rm -rf /dev/shm/ckd* ~/.cache/checkpointd
date -u
echo "== bench_restore tmpfs (repeat 4), kernel cache emptied first"
timeout 250 python3 benchmarks/bench_restore.py --state-gb 5 --dirs /dev/shm/ckd-restore --raw-threads 8,max --repeat 4 --methods raw,raw_cold,checkpointd,checkpointd_hostverify,checkpointd_cold,checkpointd_cold_hostverify --json $OUT/s31c/restore-s31c.json > $OUT/s31c/restore-s31c.log 2>&1
echo "exit $?"; grep -A16 "^-- /dev/shm" $OUT/s31c/restore-s31c.log | cut -c1-170
python3 - <<'PY' $OUT/s31c/restore-s31c.json
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["dirs"][0]["rows"]:
    print(f'{r["method"][:50]:50s}', " ".join(f"{t*1e3:.1f}" for t in r.get("times_s", [])), r.get("error", ""))
PY
rm -rf /dev/shm/ckd*
date -u
cd $OUT && tar czf s31c.tgz s31c && rm -rf s31c
