set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L
timeout 90 torchrun --nproc_per_node=2 .probe/thread_cpu.py --saves 6 --every 30 --json $OUT/thread-cpu-s11d.json 2>&1 | grep "^{" | cut -c1-700
date -u
timeout 330 torchrun --nproc_per_node=2 benchmarks/bench_stall_dist.py --state-gb 5 --every 60 --ckpts 12 \
  --methods none,checkpointd,io_only_reuse,checkpointd@CHECKPOINTD_PERSIST_THREADS=4,none --dir /dev/shm/ckd-dist --json $OUT/stall-dist-s11d.json 2>&1 | grep -v "^W11\|OMP_NUM\|\*\*\*\*\|^\[stall-dist\] " | tail -16
date -u
