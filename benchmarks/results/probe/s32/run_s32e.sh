python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site
date -u; nvidia-smi -L; nproc
mkdir -p $OUT/s32e
echo "== run_gpu.sh, persist_tmpfs stage (the final code: session 31's library, the mount table fix; bench_persist settles 1 s after each deletion), REPEAT=3"
OUT=$OUT/s32e WHEELS=/nonexistent STAGES=persist_tmpfs SKIP_DISK=1 REPEAT=3 timeout 330 bash benchmarks/run_gpu.sh > $OUT/s32e/run_gpu-s32e.log 2>&1
echo "exit $?"; sed -n '/^-- /,/^wrote/p' $OUT/s32e/run_gpu-s32e.log | cut -c1-200 | head -30
rm -rf /dev/shm/ckd*
date -u
cd $OUT && tar czf s32e.tgz s32e && rm -rf s32e
