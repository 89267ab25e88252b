python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; nproc; git log --oneline -1 2>/dev/null; git status --short | head -20; python3 -c "import zlib_ng, zstandard, torch; print('zlib_ng ok, torch', torch.__version__, torch.version.cuda)"
mkdir -p $OUT/s30b
P=benchmarks/results/probe/s30
echo "== GPU tests: device verification (NVRTC kernels) and the CUDA restores"
timeout 200 python3 -m pytest -v -p no:cacheprovider -rf --tb=short --durations=8 tests/gpu/test_device_verify_cuda.py tests/gpu/test_restore_cuda.py > $OUT/s30b/pytest-s30b.log 2>&1
echo "exit $?"; grep -E "PASSED|FAILED|ERROR|passed|failed|Error" $OUT/s30b/pytest-s30b.log | tail -40 | cut -c1-200
date -u
echo "== the kernels' first use in fresh processes (cache empty, then stored)"
export CHECKPOINTD_CACHE_DIR=/tmp/kc; rm -rf /tmp/kc
for i in cold warm1 warm2; do echo -n "$i "; timeout 60 python3 $P/rtc_first_use.py 2>&1 | tail -1; done | tee $OUT/s30b/rtc-first-use-s30b.log
unset CHECKPOINTD_CACHE_DIR
rm -rf ~/.cache/checkpointd /dev/shm/ckd*
date -u
echo "== timeline: device (populate ahead), nopop, host; warm x4 each, and 2 fresh processes"
timeout 200 python3 $P/verify_timeline.py 4 2 --json $OUT/s30b/timeline-s30b.json > $OUT/s30b/timeline-s30b.log 2>&1
echo "exit $?"; grep -vE "^\s+(parse|_allocate|optim_load|pinned_chunks|kernel_available) " $OUT/s30b/timeline-s30b.log | tail -95 | cut -c1-150
rm -rf ~/.cache/checkpointd /dev/shm/ckd*
date -u
echo "== bench_restore tmpfs (repeat 5), kernel cache emptied first"
timeout 340 python3 benchmarks/bench_restore.py --state-gb 5 --dirs /dev/shm/ckd-restore --raw-threads 8,max --repeat 5 --methods raw,raw_cold,checkpointd,checkpointd_hostverify,checkpointd_cold,checkpointd_cold_hostverify,checkpointd_phases --json $OUT/s30b/restore-s30b.json > $OUT/s30b/restore-s30b.log 2>&1
echo "exit $?"; grep -A16 "^-- /dev/shm" $OUT/s30b/restore-s30b.log | cut -c1-170
python3 - <<'PY' $OUT/s30b/restore-s30b.json
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["dirs"][0]["rows"]:
    print(f'{r["method"][:50]:50s}', " ".join(f"{t*1e3:.1f}" for t in r.get("times_s", [])), r.get("error", ""))
PY
rm -rf /dev/shm/ckd*
date -u
cd $OUT && tar czf s30b.tgz s30b && rm -rf s30b
