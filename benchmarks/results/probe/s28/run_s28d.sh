python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; nproc; git log --oneline -1 2>/dev/null; git status --short | head; python3 -c "import zlib_ng, zstandard; print('zlib_ng ok')"
mkdir -p $OUT/s28d
echo "== GPU tests (tests/gpu)"
timeout 200 python3 -m pytest -q -p no:cacheprovider -rf --tb=short tests/gpu > $OUT/s28d/pytest-gpu-s28d.log 2>&1
echo "exit $?"; tail -6 $OUT/s28d/pytest-gpu-s28d.log | cut -c1-300
date -u
echo "== apply probe: small pairs packed or not (restore_latest, fresh manager each, 8 rounds)"
rm -rf /dev/shm/ckd*
timeout 200 python3 benchmarks/results/probe/s28/apply_probe.py 8 --json $OUT/s28d/apply-probe-s28d.json > $OUT/s28d/apply-probe-s28d.log 2>&1
echo "exit $?"; tail -6 $OUT/s28d/apply-probe-s28d.log
date -u
echo "== run_gpu.sh restore_tmpfs"
rm -rf /dev/shm/ckd*
STAGES=restore_tmpfs WHEELS=.whl OUT=$OUT/s28d/rungpu BUDGET_S=240 PREFAULT_GB=0 timeout 270 bash benchmarks/run_gpu.sh > $OUT/s28d/rungpu-s28d.log 2>&1
echo "exit $?"; grep -A16 "^-- /dev/shm" $OUT/s28d/rungpu-s28d.log | tail -17 | cut -c1-200
rm -rf /dev/shm/ckd*
date -u
cd $OUT && tar czf s28d.tgz s28d && rm -rf s28d
