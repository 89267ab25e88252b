python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1
date -u; nvidia-smi -L; nproc
for v in old new newFA0 old2 new2; do
  src=$PWD/src; case $v in old*) src=$PWD/.probe/old98/src;; esac
  fa=2; [ $v = newFA0 ] && fa=0
  echo "== $v ($src) FILES_AHEAD=$fa"
  CHECKPOINTD_FILES_AHEAD=$fa PYTHONPATH=/tmp/site:$src timeout 100 python3 benchmarks/bench_persist.py --state-gb 5 --dirs /dev/shm/ckd-p --methods raw,checkpointd,checkpointd_recycle --raw-threads max --repeat 2 --json $OUT/persist-$v-s24b.json 2>&1 | grep -E "^raw|^checkpointd|rror" | cut -c1-160
  rm -rf /dev/shm/ckd-p
  CHECKPOINTD_FILES_AHEAD=$fa PYTHONPATH=/tmp/site:$src timeout 100 python3 benchmarks/bench_restore.py --state-gb 5 --dirs /dev/shm/ckd-r --methods raw,checkpointd --raw-threads max --repeat 3 --json $OUT/restore-$v-s24b.json 2>&1 | grep -E "^raw|^checkpointd|rror" | cut -c1-160
  rm -rf /dev/shm/ckd-r
  date -u
done
