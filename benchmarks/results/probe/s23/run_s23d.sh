python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
REPO=$PWD; date -u; nvidia-smi -L; nproc
echo "== group 2 of s23c without the benchmark smoke tests (background)"
ls tests/test_*.py | sort | grep -v test_distributed_ | awk 'NR%3==1' | grep -v test_benchmarks_smoke > /tmp/g2
mkdir -p /tmp/bt2
TMPDIR=/tmp/bt2 timeout 330 python3 -m pytest -q $(cat /tmp/g2) -p no:cacheprovider --timeout 200 -rf --tb=short --durations=12 --basetemp=/tmp/bt2/pt > $OUT/suite-g2-s23d.log 2>&1 &
G2=$!
echo "== run_gpu.sh as test_run_gpu_sh_runs_the_stages_asked_for runs it (CUDA hidden, --cpu --tiny)"
T=$(mktemp -d)
( cd $T && env OUT=$T/out TMPFS_DIR=$T/t DISK_DIR=$T/d STAGES=restore_tmpfs BENCH_ARGS="--cpu --tiny" CUDA_VISIBLE_DEVICES="" WHEELS=$T/none PYTHON=python3 PYTHONFAULTHANDLER=1 \
  timeout 200 bash $REPO/benchmarks/run_gpu.sh > $OUT/rungpu-s23d.log 2>&1 ) &
R=$!
for i in $(seq 1 18); do sleep 10; kill -0 $R 2>/dev/null || break; done
if kill -0 $R 2>/dev/null; then
  echo "run_gpu.sh still running after $((i*10)) s:"
  ps -eo pid,ppid,stat,wchan:30,etime,args --forest | grep -v "ps -eo" | grep -E "python|bash|timeout" | cut -c1-220
  for p in $(pgrep -f bench_restore); do echo "-- $p"; cat /proc/$p/status | grep -E "State|Threads"; kill -ABRT $p; done
  sleep 3
fi
wait $R; echo "run_gpu.sh rc $?"
tail -40 $OUT/rungpu-s23d.log | cut -c1-250
wait $G2; echo "group 2 rc $?"
grep -E "^FAILED|^ERROR|passed|failed|^[0-9.]+s (call|setup)" $OUT/suite-g2-s23d.log | head -30 | cut -c1-200
date -u
