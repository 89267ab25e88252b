python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L
B="python3 benchmarks/bench_stall.py --state-gb 5 --every 100 --ckpts 3 --dir /dev/shm/ckd-h25"
F='grep -E ^none|^checkpointd'
echo "== A mmap, 16 MiB slices"
CHECKPOINTD_WRITE_MODE=mmap CHECKPOINTD_WRITE_SLICE_MB=16 timeout 150 $B --prefault-gb 20 --methods none,checkpointd_host25 --json $OUT/host25-mmap16-s21h.json 2>&1 | grep -E "^none|^checkpointd" | cut -c1-120
echo "== B pwrite, 4 I/O threads"
CHECKPOINTD_IO_THREADS=4 timeout 150 $B --prefault-gb 0 --methods none,checkpointd_host25 --json $OUT/host25-io4-s21h.json 2>&1 | grep -E "^none|^checkpointd" | cut -c1-120
echo "== C default again"
timeout 150 $B --prefault-gb 0 --methods none,checkpointd_host25 --json $OUT/host25-default-s21h.json 2>&1 | grep -E "^none|^checkpointd" | cut -c1-120
date -u
