python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1
date -u; nvidia-smi -L; nproc; git log --oneline -1 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD/src
mkdir -p $OUT/s25c
echo "== 20 GB"
timeout 500 python3 benchmarks/bench_stall.py --state-gb 20 --every 100 --ckpts 3 --prefault-gb 40 \
  --methods none,checkpointd,checkpointd_device,copy_only,none --dir /dev/shm/ckd-20 --json $OUT/s25c/stall-20gb-s25c.json > $OUT/s25c/stall-20gb-s25c.log 2>&1
echo "exit $?"; grep -v "^\[stall\] " $OUT/s25c/stall-20gb-s25c.log | tail -22 | cut -c1-250
rm -rf /dev/shm/ckd*
date -u
cd $OUT && tar czf s25c.tgz s25c && rm -rf s25c
