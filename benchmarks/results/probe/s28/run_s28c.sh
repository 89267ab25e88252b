python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; nproc; git log --oneline -1 2>/dev/null; python3 -c "import zlib_ng, zstandard; print('zlib_ng ok')"
lscpu | grep -E "Model name|L3|NUMA node\(s\)|Thread"; free -g | head -2
mkdir -p $OUT/s28c
echo "== host memory traffic of a verify-first restore, pass by pass (4.83 GB, best of 5)"
rm -rf /dev/shm/ckd*
timeout 300 python3 benchmarks/results/probe/s28/mem_floor_probe.py 4.83 5 --json $OUT/s28c/mem-floor-s28c.json > $OUT/s28c/mem-floor-s28c.log 2>&1
echo "exit $?"; tail -16 $OUT/s28c/mem-floor-s28c.log
rm -rf /dev/shm/ckd*
date -u
cd $OUT && tar czf s28c.tgz s28c && rm -rf s28c
