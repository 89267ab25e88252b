python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; nproc; git log --oneline -1 2>/dev/null; python3 -c "import zlib_ng, zstandard; print('zlib_ng ok')"; python3 -c "import triton; print('triton', triton.__version__)"
mkdir -p $OUT/s29f
rm -rf /dev/shm/ckd*
echo "== self-test (torch-ops lanes against zlib)"
PROBE_CPU=1 python3 benchmarks/results/probe/s29/gpu_crc_probe.py 2>&1 | tail -2
for b in 128 64 256; do
  echo "== gpu crc probe, 4.83 GB, Triton BLOCK=$b"
  PROBE_BLOCK=$b PROBE_ROUNDS=$([ $b = 128 ] && echo 5 || echo 3) timeout 150 python3 benchmarks/results/probe/s29/gpu_crc_probe.py 4.83 --json $OUT/s29f/gpu-crc-s29f-b$b.json > $OUT/s29f/gpu-crc-s29f-b$b.log 2>&1
  echo "exit $?"; tail -12 $OUT/s29f/gpu-crc-s29f-b$b.log
done
rm -rf /dev/shm/ckd*
date -u
cd $OUT && tar czf s29f.tgz s29f && rm -rf s29f
