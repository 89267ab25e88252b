set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1
NEW=/tmp/site:$PWD/src; OLD=/tmp/site:$PWD/.probe/old_src/src
F="grep -v ^W11\|OMP_NUM\|\*\*\*\*"
date -u; nvidia-smi -L
PYTHONPATH=$NEW timeout 100 torchrun --nproc_per_node=2 .probe/thread_cpu.py --saves 5 --every 30 --json $OUT/thread-cpu-s11b-new.json 2>&1 | grep -v "^W11\|OMP_NUM\|\*\*\*\*" | cut -c1-600
PYTHONPATH=$OLD timeout 100 torchrun --nproc_per_node=2 .probe/thread_cpu.py --saves 5 --every 30 --json $OUT/thread-cpu-s11b-old.json 2>&1 | grep -v "^W11\|OMP_NUM\|\*\*\*\*" | cut -c1-600
date -u
PYTHONPATH=$NEW timeout 240 torchrun --nproc_per_node=2 benchmarks/bench_stall_dist.py --state-gb 5 --every 60 --ckpts 8 \
  --methods none,checkpointd,none,checkpointd,none --dir /dev/shm/ckd-dist --json $OUT/stall-dist-s11b-new.json 2>&1 | grep -v "^W11\|OMP_NUM\|\*\*\*\*\|^\[stall-dist\] " | tail -22
date -u
PYTHONPATH=$OLD timeout 170 torchrun --nproc_per_node=2 benchmarks/bench_stall_dist.py --state-gb 5 --every 60 --ckpts 8 \
  --methods none,checkpointd,none --dir /dev/shm/ckd-dist --json $OUT/stall-dist-s11b-old.json 2>&1 | grep -v "^W11\|OMP_NUM\|\*\*\*\*\|^\[stall-dist\] " | tail -16
date -u
PYTHONPATH=$NEW timeout 100 python3 benchmarks/bench_stall.py --state-gb 2.5 --every 60 --ckpts 8 --methods none,checkpointd,none \
  --dir /dev/shm/ckd --json $OUT/stall-s11b-2.5gb-ref.json 2>&1 | tail -14
date -u
