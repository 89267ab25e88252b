set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; git log --oneline -1 2>/dev/null
timeout 330 torchrun --nproc_per_node=2 benchmarks/bench_stall_dist.py --state-gb 5 --every 60 --ckpts 8 \
  --methods none,copy_only,io_only_reuse,checkpointd,io_only_reuse,checkpointd,none --dir /dev/shm/ckd-dist --json $OUT/stall-dist-s12c.json 2>&1 | grep -v "^W11\|OMP_NUM\|\*\*\*\*\|^\[stall-dist\] " | grep -v "stats()\|construction" | tail -16 | cut -c1-200
date -u
timeout 150 python3 -m pytest -q -x tests/gpu tests/test_persist_process.py tests/test_recycle.py -p no:cacheprovider 2>&1 | tail -3
date -u
CHECKPOINTD_TEST_BACKEND=nccl timeout 150 python3 -m pytest -q tests/test_distributed_recycle.py tests/test_distributed_reads.py tests/test_distributed_resharding.py -p no:cacheprovider 2>&1 | tail -3
date -u
