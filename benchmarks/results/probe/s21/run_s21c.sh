python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; nproc
echo "== one GPU, half the state (D=2048 L=4)"
CUDA_VISIBLE_DEVICES=0 timeout 200 python3 benchmarks/bench_stall.py --D 2048 --L 4 --every 100 --ckpts 3 --prefault-gb 20 \
  --methods none,checkpointd,none --dir /dev/shm/ckd-1gpu --json $OUT/stall-1gpu-s21c.json 2>&1 | grep -v "^\[stall\] " | tail -12 | cut -c1-220
date -u
echo "== two GPUs, FSDP2, sharded (D=2048 L=8)"
timeout 330 torchrun --nproc_per_node=2 benchmarks/bench_stall_dist.py --state-gb 5 --every 100 --ckpts 3 --prefault-gb 20 \
  --methods none,checkpointd,none --dir /dev/shm/ckd-dist --ref-json $OUT/stall-1gpu-s21c.json --json $OUT/stall-dist-s21c.json 2>&1 \
  | grep -v "^W11\|OMP_NUM\|\*\*\*\*\|^\[stall-dist\] " | tail -22 | cut -c1-240
date -u
