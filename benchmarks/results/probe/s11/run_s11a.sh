set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
nvidia-smi -L; nproc; lscpu | grep -i -E "numa|socket|thread|model name"; date -u
T=CHECKPOINTD_PERSIST_THREADS; P=CHECKPOINTD_PERSIST_PACE_GBPS
timeout 420 torchrun --nproc_per_node=2 benchmarks/bench_stall_dist.py --state-gb 5 --every 60 --ckpts 10 \
  --methods none,checkpointd,io_only_reuse,io_only_reuse@$T=4,io_only_reuse@$T=2,io_only_reuse@$P=3,checkpointd@$T=4,none \
  --dir /dev/shm/ckd-dist --json $OUT/stall-dist-s11a.json 2>&1 | grep -v "^W11\|OMP_NUM\|\*\*\*\*" | tail -40
date -u
timeout 120 torchrun --nproc_per_node=2 .probe/thread_cpu.py --saves 5 --every 30 --json $OUT/thread-cpu-s11a.json 2>&1 | grep -v "^W11\|OMP_NUM\|\*\*\*\*" | head -30
date -u
