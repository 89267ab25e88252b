python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1
date -u; nvidia-smi -L; nproc; git log --oneline -1 2>/dev/null
NEW=/tmp/site:$PWD/src; OLD=/tmp/site:$PWD/.probe/oldc19/src
mkdir -p $OUT/s25a
echo "== NCCL: test_distributed_recycle.py (new code)"
PYTHONPATH=$NEW:$PWD/tests CHECKPOINTD_TEST_BACKEND=nccl timeout 110 python3 -m pytest -q -p no:cacheprovider tests/test_distributed_recycle.py 2>&1 | tail -4
date -u
run() {  # $1 label, $2 pythonpath, $3 prefault
  rm -rf /dev/shm/ckd-dist
  PYTHONPATH=$2 timeout 120 torchrun --nproc_per_node=2 benchmarks/bench_stall_dist.py --state-gb 5 --every 60 --ckpts 3 --prefault-gb $3 \
    --methods none,checkpointd,none --dir /dev/shm/ckd-dist --json $OUT/s25a/stall-dist-$1.json > $OUT/s25a/stall-dist-$1.log 2>&1
  echo "== $1 exit $?"; PYTHONPATH= python3 .probe/first_write.py $OUT/s25a/stall-dist-$1.json; grep -i "warn\|drift\|error" $OUT/s25a/stall-dist-$1.log | head -3 | cut -c1-200
  date -u
}
run old1 $OLD 20
run new1 $NEW 0
run old2 $OLD 0
run new2 $NEW 0
rm -rf /dev/shm/ckd-dist
cd $OUT && tar czf s25a.tgz s25a && rm -rf s25a
