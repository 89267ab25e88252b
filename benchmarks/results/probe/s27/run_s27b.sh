python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; nproc; lscpu | grep -i "^CPU(s)\|Thread(s) per core\|NUMA node(s)"; python3 -c "import zlib_ng; print('zlib_ng ok')"
mkdir -p $OUT/s27b
echo "== NCCL: distributed recycle tests"
PYTHONPATH=$PYTHONPATH:$PWD/tests CHECKPOINTD_TEST_BACKEND=nccl timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_distributed_recycle.py 2>&1 | tail -3
date -u
T2=checkpointd@CHECKPOINTD_PERSIST_THREADS=2
echo "== run_gpu.sh stall_dist (interleaved, with 2 persist threads a rank beside the default)"
rm -rf /dev/shm/ckd*
STAGES=stall_dist WHEELS=.whl OUT=$OUT/s27b/rungpu BUDGET_S=480 PREFAULT_GB=0 DIST_CKPTS=6 \
  DIST_METHODS=none,checkpointd,$T2,none,checkpointd,$T2,none,checkpointd,$T2,none timeout 500 bash benchmarks/run_gpu.sh > $OUT/s27b/rungpu-s27b.log 2>&1
echo "exit $?"; sed -n '/################ summary/,$p' $OUT/s27b/rungpu-s27b.log | grep -v "stats()\|construction" | tail -60 | cut -c1-230
rm -rf /dev/shm/ckd*
date -u
cd $OUT && tar czf s27b.tgz s27b && rm -rf s27b
