set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L
timeout 420 torchrun --nproc_per_node=2 benchmarks/bench_stall_dist.py --state-gb 5 --every 60 --ckpts 10 \
  --methods none,copy_only,io_only_reuse,checkpointd,copy_only,checkpointd,none --dir /dev/shm/ckd-dist --json $OUT/stall-dist-s12b.json 2>&1 | grep -v "^W11\|OMP_NUM\|\*\*\*\*\|^\[stall-dist\] " | grep -v "stats()\|construction" | tail -14 | cut -c1-200
date -u
CUDA_VISIBLE_DEVICES=0 timeout 160 python3 benchmarks/bench_stall.py --state-gb 2.5 --every 60 --ckpts 6 \
  --methods none,copy_only,io_only_reuse,checkpointd,none --dir /dev/shm/ckd --json $OUT/stall-s12b-2.5gb-ref.json 2>&1 | grep -v "stats()\|construction" | tail -7 | cut -c1-200
date -u
