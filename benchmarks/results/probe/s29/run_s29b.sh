python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; nproc; git log --oneline -1 2>/dev/null; python3 -c "import zlib_ng, zstandard; print('zlib_ng ok')"
cat /sys/kernel/mm/transparent_hugepage/shmem_enabled; grep /dev/shm /proc/mounts; uname -r; lscpu | grep -E "Model name|L3|NUMA node\(s\)|Thread"
mkdir -p $OUT/s29b
rm -rf /dev/shm/ckd*
echo "== gap probe: A (defaults), B (no staging arena), A again; 6 rounds each"
for v in A1 B A2; do
  if [ $v = B ]; then export PROBE_NO_ARENA=1; else unset PROBE_NO_ARENA; fi
  timeout 150 python3 benchmarks/results/probe/s29/gap_probe.py 6 --json $OUT/s29b/gap-probe-s29b-$v.json > $OUT/s29b/gap-probe-s29b-$v.log 2>&1
  echo "== $v exit $?"; tail -26 $OUT/s29b/gap-probe-s29b-$v.log
done
rm -rf /dev/shm/ckd*
date -u
cd $OUT && tar czf s29b.tgz s29b && rm -rf s29b
