python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; nproc; git log --oneline -1 2>/dev/null; git status --short | head -20; python3 -c "import zlib_ng, zstandard, torch; print('zlib_ng ok, torch', torch.__version__, torch.version.cuda)"
mkdir -p $OUT/s30c
P=benchmarks/results/probe/s30
echo "== GPU tests: device verification (NVRTC kernels) and the CUDA restores"
timeout 120 python3 -m pytest -v -p no:cacheprovider -rf --tb=short --durations=8 tests/gpu/test_device_verify_cuda.py tests/gpu/test_restore_cuda.py > $OUT/s30c/pytest-s30c.log 2>&1
echo "exit $?"; grep -E "PASSED|FAILED|ERROR|passed|failed|Error" $OUT/s30c/pytest-s30c.log | tail -40 | cut -c1-200
date -u
echo "== timeline: device (no populate), pop2, pop4, host; warm x4 each, and 2 fresh processes"
PROBE_MODES=device,pop2,pop4,host timeout 170 python3 $P/verify_timeline.py 4 2 --json $OUT/s30c/timeline-s30c.json > $OUT/s30c/timeline-s30c.log 2>&1
echo "exit $?"; grep -vE "^\s+(parse|_allocate|optim_load|pinned_chunks|kernel_available) " $OUT/s30c/timeline-s30c.log | tail -75 | cut -c1-150
rm -rf ~/.cache/checkpointd /dev/shm/ckd*
date -u
echo "== bench_restore tmpfs (repeat 5), kernel cache emptied first"
timeout 290 python3 benchmarks/bench_restore.py --state-gb 5 --dirs /dev/shm/ckd-restore --raw-threads 8,max --repeat 5 --methods raw,raw_cold,checkpointd,checkpointd_hostverify,checkpointd_cold,checkpointd_cold_hostverify --json $OUT/s30c/restore-s30c.json > $OUT/s30c/restore-s30c.log 2>&1
echo "exit $?"; grep -A16 "^-- /dev/shm" $OUT/s30c/restore-s30c.log | cut -c1-170
python3 - <<'PY' $OUT/s30c/restore-s30c.json
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["dirs"][0]["rows"]:
    print(f'{r["method"][:50]:50s}', " ".join(f"{t*1e3:.1f}" for t in r.get("times_s", [])), r.get("error", ""))
PY
rm -rf /dev/shm/ckd*
date -u
cd $OUT && tar czf s30c.tgz s30c && rm -rf s30c
