python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; nproc
mkdir -p $OUT/s25e
for every in 60 120; do
  rm -rf /dev/shm/ckd-dist
  timeout 80 torchrun --nproc_per_node=2 benchmarks/bench_stall_dist.py --state-gb 5 --every $every --ckpts 3 --prefault-gb 0 \
    --methods none,checkpointd --dir /dev/shm/ckd-dist --json $OUT/s25e/stall-dist-every$every.json > $OUT/s25e/stall-dist-every$every.log 2>&1
  echo "== every $every exit $?"; PYTHONPATH= python3 .probe/first_write2.py $OUT/s25e/stall-dist-every$every.json
  date -u
done
rm -rf /dev/shm/ckd-dist
cd $OUT && tar czf s25e.tgz s25e && rm -rf s25e
