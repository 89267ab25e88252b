export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L
timeout 400 torchrun --nproc_per_node=2 benchmarks/bench_stall_dist.py --state-gb 5 --every 60 --ckpts 5 --prefault-gb 20 \
  --methods none,checkpointd,none,checkpointd,none --dir /dev/shm/ckd-dist --ref-json .probe/stall-1gpu-s21c.json --json $OUT/stall-dist-s21d.json 2>&1 \
  | grep -v "^W11\|OMP_NUM\|\*\*\*\*\|^\[stall-dist\] " | tail -24 | cut -c1-240
date -u
