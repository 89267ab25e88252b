python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; nproc; free -g | head -2
mkdir -p $OUT/s26a
echo "== NCCL: distributed tests"
PYTHONPATH=$PYTHONPATH:$PWD/tests CHECKPOINTD_TEST_BACKEND=nccl timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_distributed_recycle.py 2>&1 | tail -4
date -u
M=none,checkpointd,none,checkpointd,none,checkpointd,none
echo "== 1 GPU, half the state, interleaved"
rm -rf /dev/shm/ckd*
CUDA_VISIBLE_DEVICES=0 timeout 170 python3 benchmarks/bench_stall.py --state-gb 2.5 --every 60 --ckpts 6 --prefault-gb 0 \
  --methods $M --dir /dev/shm/ckd-1 --json $OUT/s26a/stall-1gpu-half.json > $OUT/s26a/stall-1gpu-half.log 2>&1
echo "exit $?"; grep -v "^\[stall\] " $OUT/s26a/stall-1gpu-half.log | grep -v "stats()" | tail -22 | cut -c1-260
rm -rf /dev/shm/ckd*
date -u
echo "== 2 GPUs, interleaved"
timeout 330 torchrun --nproc_per_node=2 benchmarks/bench_stall_dist.py --state-gb 5 --every 60 --ckpts 6 --prefault-gb 0 \
  --methods $M --dir /dev/shm/ckd-dist --ref-json $OUT/s26a/stall-1gpu-half.json --json $OUT/s26a/stall-dist.json > $OUT/s26a/stall-dist.log 2>&1
echo "exit $?"; grep -v "^\[stall-dist\] " $OUT/s26a/stall-dist.log | grep -v "stats()" | tail -40 | cut -c1-260
rm -rf /dev/shm/ckd*
date -u
cd $OUT && tar czf s26a.tgz s26a && rm -rf s26a
