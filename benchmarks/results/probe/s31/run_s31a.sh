python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; nproc; python3 -c "import zlib_ng, zstandard, torch; print('zlib_ng ok, torch', torch.__version__, torch.version.cuda)"
mkdir -p $OUT/s31a
P=benchmarks/results/probe/s31
echo "== GPU tests: device verification and the CUDA restores"
timeout 120 python3 -m pytest -v -p no:cacheprovider -rf --tb=short --durations=5 tests/gpu/test_device_verify_cuda.py tests/gpu/test_restore_cuda.py > $OUT/s31a/pytest-s31a.log 2>&1
echo "exit $?"; grep -E "FAILED|ERROR|passed|failed|Error" $OUT/s31a/pytest-s31a.log | tail -20 | cut -c1-200
date -u
echo "== A/B: old, idle, new, host; warm x5 each, 2 profiled, 2 fresh processes"
PROFILE=2 timeout 240 python3 $P/restore_ab.py 5 2 --json $OUT/s31a/ab-s31a.json > $OUT/s31a/ab-s31a.log 2>&1
echo "exit $?"; grep -E "^round|^cold|^  |^profile" $OUT/s31a/ab-s31a.log | cut -c1-150
grep -A28 "last warm round, new" $OUT/s31a/ab-s31a.log | cut -c1-150
rm -rf /dev/shm/ckd*
date -u
cd $OUT && tar czf s31a.tgz s31a && rm -rf s31a
