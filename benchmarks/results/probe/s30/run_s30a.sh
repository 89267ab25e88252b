python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; nproc; git log --oneline -1 2>/dev/null; git status --short | head; python3 -c "import zlib_ng, zstandard, torch; print('zlib_ng ok, torch', torch.__version__, torch.version.cuda)"
mkdir -p $OUT/s30a
P=benchmarks/results/probe/s30
echo "== GPU tests: device verification (NVRTC kernels) and the CUDA restores"
timeout 170 python3 -m pytest -q -p no:cacheprovider -rf --tb=short tests/gpu/test_device_verify_cuda.py tests/gpu/test_restore_cuda.py > $OUT/s30a/pytest-s30a.log 2>&1
echo "exit $?"; grep -E "passed|failed|Error|error" $OUT/s30a/pytest-s30a.log | tail -12 | cut -c1-300
date -u
echo "== the kernels' first use in fresh processes (cache empty, then stored)"
export CHECKPOINTD_KERNEL_CACHE=/tmp/kc; rm -rf /tmp/kc
for i in cold warm1 warm2 warm3; do echo -n "$i "; timeout 60 python3 $P/rtc_first_use.py 2>&1 | tail -1; done | tee $OUT/s30a/rtc-first-use-s30a.log
echo -n "big "; timeout 120 python3 $P/rtc_first_use.py --big 4.83 --repeat 6 2>&1 | tail -1 | tee -a $OUT/s30a/rtc-first-use-s30a.log
unset CHECKPOINTD_KERNEL_CACHE
rm -rf ~/.cache/checkpointd /dev/shm/ckd*
date -u
echo "== timeline of restores verified on the GPU and on the host (warm x4 each), and 3 fresh processes"
timeout 200 python3 $P/verify_timeline.py 4 3 --json $OUT/s30a/timeline-s30a.json > $OUT/s30a/timeline-s30a.log 2>&1
echo "exit $?"; grep -vE "^\s+(parse|_allocate)" $OUT/s30a/timeline-s30a.log | tail -120 | cut -c1-160
rm -rf ~/.cache/checkpointd /dev/shm/ckd*
date -u
echo "== bench_restore tmpfs (repeat 5)"
timeout 330 python3 benchmarks/bench_restore.py --state-gb 5 --dirs /dev/shm/ckd-restore --raw-threads 8,max --repeat 5 --methods raw,raw_cold,checkpointd,checkpointd_deviceverify,checkpointd_cold,checkpointd_cold_deviceverify --json $OUT/s30a/restore-s30a.json > $OUT/s30a/restore-s30a.log 2>&1
echo "exit $?"; grep -A14 "^-- /dev/shm" $OUT/s30a/restore-s30a.log | cut -c1-170
python3 - <<'PY' $OUT/s30a/restore-s30a.json
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["dirs"][0]["rows"]:
    print(f'{r["method"][:50]:50s}', " ".join(f"{t*1e3:.1f}" for t in r.get("times_s", [])), r.get("error", ""))
PY
rm -rf /dev/shm/ckd*
date -u
cd $OUT && tar czf s30a.tgz s30a && rm -rf s30a
