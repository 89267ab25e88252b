set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; nproc; free -g | head -2
CHECKPOINTD_TEST_BACKEND=nccl timeout 150 python3 -m pytest -q tests/test_distributed_recycle.py tests/test_distributed_reads.py tests/test_distributed_resharding.py -p no:cacheprovider 2>&1 | tail -3
date -u
timeout 380 torchrun --nproc_per_node=2 benchmarks/bench_stall_dist.py --state-gb 5 --every 60 --ckpts 8 \
  --methods none,copy_only,io_only_reuse,checkpointd,checkpointd,none --dir /dev/shm/ckd-dist --json $OUT/stall-dist-s16b.json 2>&1 | grep -v "^W11\|OMP_NUM\|\*\*\*\*\|^\[stall-dist\] " | grep -v "stats()\|construction" | tail -22 | cut -c1-220
date -u
