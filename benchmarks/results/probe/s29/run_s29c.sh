python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; nproc; git log --oneline -1 2>/dev/null; python3 -c "import zlib_ng, zstandard; print('zlib_ng ok')"
cat /sys/kernel/mm/transparent_hugepage/shmem_enabled; grep /dev/shm /proc/mounts; uname -r; lscpu | grep -E "Model name|L3|NUMA node\(s\)|Thread"
mkdir -p $OUT/s29c
rm -rf /dev/shm/ckd*
echo "== gap probe: A (defaults), noahead (CHECKPOINTD_FILES_AHEAD=0), sleep3 (3 s after close), B (no staging arena); 5 rounds each"
for v in A noahead sleep3 B; do
  unset PROBE_NO_ARENA CHECKPOINTD_FILES_AHEAD PROBE_SLEEP
  case $v in B) export PROBE_NO_ARENA=1;; noahead) export CHECKPOINTD_FILES_AHEAD=0;; sleep3) export PROBE_SLEEP=3;; esac
  timeout 150 python3 benchmarks/results/probe/s29/gap_probe.py 5 --json $OUT/s29c/gap-probe-s29c-$v.json > $OUT/s29c/gap-probe-s29c-$v.log 2>&1
  echo "== $v exit $?"; tail -24 $OUT/s29c/gap-probe-s29c-$v.log
done
rm -rf /dev/shm/ckd*
date -u
cd $OUT && tar czf s29c.tgz s29c && rm -rf s29c
