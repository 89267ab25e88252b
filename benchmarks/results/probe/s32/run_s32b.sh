python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; nproc; git log --oneline -1 2>/dev/null | cat
python3 -c "import zlib_ng, zstandard, torch; print('zlib_ng ok, torch', torch.__version__, torch.version.cuda)"
mkdir -p $OUT/s32b
P=benchmarks/results/probe/s32
rm -rf /dev/shm/ckd*
echo "== tests: the reservation ahead (a real tmpfs each) and the CUDA save paths"
timeout 100 python3 -m pytest -q -p no:cacheprovider -rf --tb=short tests/test_reserve_ahead.py tests/gpu/test_cuda_paths.py > $OUT/s32b/pytest-s32b.log 2>&1
echo "exit $?"; grep -E "FAILED|ERROR|passed|failed" $OUT/s32b/pytest-s32b.log | tail -8 | cut -c1-200
date -u
echo "== phases: reserved ahead (new) against reserved when written, no files ahead, a pause after each removal"
timeout 100 python3 $P/persist_probe.py --gb 5 --saves 4 --raw-reps 1 --variants noahead_pause,noreserve_pause,noahead_pause,noreserve_pause \
  --json $OUT/s32b/persist-probe-s32b.json > $OUT/s32b/persist-probe-s32b.log 2>&1
echo "exit $?"; grep -E "^raw|^==|^  save" $OUT/s32b/persist-probe-s32b.log | cut -c1-170
rm -rf /dev/shm/ckd*
date -u
echo "== bench_persist.py tmpfs, repeat 3"
timeout 260 python3 benchmarks/bench_persist.py --state-gb 5 --dirs /dev/shm/ckd-persist --repeat 3 \
  --methods raw,torch_save,checkpointd,checkpointd_noreserve,checkpointd_recycle,checkpointd_fast \
  --json $OUT/s32b/persist-s32b.json > $OUT/s32b/persist-s32b.log 2>&1
echo "exit $?"; sed -n '/^== persist/,$p' $OUT/s32b/persist-s32b.log | cut -c1-230
rm -rf /dev/shm/ckd*
date -u
cd $OUT && tar czf s32b.tgz s32b && rm -rf s32b
