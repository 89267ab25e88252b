python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; python3 -c "import zlib_ng, zstandard, torch; print('zlib_ng ok, torch', torch.__version__, torch.version.cuda)"
mkdir -p $OUT/s31e
P=benchmarks/results/probe/s31
echo "== GPU tests on the final code: device verification and the CUDA restores"
timeout 90 python3 -m pytest -v -p no:cacheprovider -rf --tb=short tests/gpu/test_device_verify_cuda.py tests/gpu/test_restore_cuda.py > $OUT/s31e/pytest-s31e.log 2>&1
echo "exit $?"; grep -E "FAILED|ERROR|passed|failed|Error" $OUT/s31e/pytest-s31e.log | tail -10 | cut -c1-200
date -u
echo "== fresh processes: CRC tables per file size (old) against built once (new), 2 each, alternated"
PROBE_GB=5 PROBE_MODES=new PROFILE=0 timeout 105 python3 $P/restore_ab.py 1 2 --json $OUT/s31e/ab-s31e.json > $OUT/s31e/ab-s31e.log 2>&1
echo "exit $?"; grep -E "^round|^cold|^  (new|cold)" $OUT/s31e/ab-s31e.log | cut -c1-150
grep -E "^cold|crc32_of" $OUT/s31e/ab-s31e.log | cut -c1-120
rm -rf /dev/shm/ckd*
date -u
cd $OUT && tar czf s31e.tgz s31e && rm -rf s31e
