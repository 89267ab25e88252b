python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1
date -u; nvidia-smi -L; nproc
B="python3 benchmarks/bench_stall.py --state-gb 5 --every 100 --ckpts 3 --dir /dev/shm/ckd-h25 --prefault-gb 20 --methods none,checkpointd_host25"
for v in old new; do
  src=$PWD/src; [ $v = old ] && src=$PWD/.probe/old/src
  echo "== $v ($src): host25"
  PYTHONPATH=/tmp/site:$src timeout 100 $B --json $OUT/host25-$v-s23c.json 2>&1 | grep -E "^none|^checkpointd|rror" | cut -c1-200
  date -u
done
export PYTHONPATH=/tmp/site:$PWD/src
echo "== the whole test suite on a CUDA host, four groups at once (no S3 server, no PhysicsNeMo here)"
ls tests/test_*.py | sort > /tmp/all
grep test_distributed_ /tmp/all > /tmp/g0
grep -v test_distributed_ /tmp/all | awk 'NR%3==0' > /tmp/g1
grep -v test_distributed_ /tmp/all | awk 'NR%3==1' > /tmp/g2
grep -v test_distributed_ /tmp/all | awk 'NR%3==2' > /tmp/g3
for g in 0 1 2 3; do
  mkdir -p /tmp/bt$g
  TMPDIR=/tmp/bt$g timeout 400 python3 -m pytest -q $(cat /tmp/g$g) $([ $g = 1 ] && echo tests/gpu) -p no:cacheprovider --timeout 200 -rf --tb=short --basetemp=/tmp/bt$g/pt > $OUT/suite-g$g-s23c.log 2>&1 &
done
wait
for g in 0 1 2 3; do echo "group $g: $(wc -l < /tmp/g$g) files"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/suite-g$g-s23c.log | tail -12 | cut -c1-300; done
date -u
