python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; nproc; git log --oneline -1 2>/dev/null; python3 -c "import zlib_ng, zstandard; print('zlib_ng ok')"
cat /sys/kernel/mm/transparent_hugepage/shmem_enabled; grep /dev/shm /proc/mounts; uname -r; lscpu | grep -E "Model name|L3|NUMA node\(s\)|Thread"
mkdir -p $OUT/s29a
rm -rf /dev/shm/ckd*
echo "== gap probe (8 rounds)"
timeout 240 python3 benchmarks/results/probe/s29/gap_probe.py 8 --json $OUT/s29a/gap-probe-s29a.json > $OUT/s29a/gap-probe-s29a.log 2>&1
echo "exit $?"; tail -32 $OUT/s29a/gap-probe-s29a.log
rm -rf /dev/shm/ckd*
date -u
cd $OUT && tar czf s29a.tgz s29a && rm -rf s29a
