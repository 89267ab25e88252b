set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; nproc
cat /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/shmem_enabled; grep -E " /dev/shm " /proc/mounts
R=io_only_reuse; P=$R@CHECKPOINTD_PROBE_POPULATE=1; K=$R@CHECKPOINTD_PROBE_KEEPMAP=1; W=$R@CHECKPOINTD_WRITE_MODE=pwrite
D=checkpointd_device; M=none,$R,$K,$P,$W,$D,$R,$K,$P,$W,$D@CHECKPOINTD_WRITE_MODE=pwrite,none
timeout 520 python3 benchmarks/bench_stall.py --state-gb 5 --every 60 --ckpts 8 --step-counters --methods $M --dir /dev/shm/ckd-bench/stall --json $OUT/stall-s17b-maps.json ${EXTRA:-} 2>&1 | grep -v "stats()\|construction" | grep -v "^\[stall\] [a-z_#@=A-Z0-9]*: {" | grep -v "^   [a-z_#@=A-Z0-9]*: [0-9]* steps >" | tail -30 | cut -c1-330
date -u
