python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; nproc; git log --oneline -1 2>/dev/null; python3 -c "import zlib_ng, zstandard; print('zlib_ng ok')"
mkdir -p $OUT/s27a
echo "== GPU tests (tests/gpu)"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tail -4
date -u
echo "== run_gpu.sh persist_tmpfs,restore_tmpfs"
rm -rf /dev/shm/ckd*
STAGES=persist_tmpfs,restore_tmpfs WHEELS=.whl OUT=$OUT/s27a/rungpu BUDGET_S=330 PREFAULT_GB=0 timeout 360 bash benchmarks/run_gpu.sh > $OUT/s27a/rungpu-s27a.log 2>&1
echo "exit $?"; sed -n '/################ summary/,$p' $OUT/s27a/rungpu-s27a.log | tail -60 | cut -c1-260
rm -rf /dev/shm/ckd*
date -u
cd $OUT && tar czf s27a.tgz s27a && rm -rf s27a
