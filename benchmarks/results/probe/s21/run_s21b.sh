python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L
B="python3 benchmarks/bench_restore.py --state-gb 5 --dirs /dev/shm/ckd-restore --repeat 4 --raw-threads 16"
echo "== A default"; timeout 150 $B --methods raw,checkpointd,checkpointd_cold --json $OUT/cold-default-s21b.json 2>&1 | tail -4
echo "== B chunk 8 MiB"; CHECKPOINTD_RESTORE_CHUNK_MB=8 timeout 120 $B --methods checkpointd,checkpointd_cold --json $OUT/cold-chunk8-s21b.json 2>&1 | tail -3
echo "== C pageable"; CHECKPOINTD_RESTORE_H2D=pageable timeout 120 $B --methods checkpointd,checkpointd_cold --json $OUT/cold-pageable-s21b.json 2>&1 | tail -3
echo "== D default again"; timeout 120 $B --methods checkpointd,checkpointd_cold --json $OUT/cold-default2-s21b.json 2>&1 | tail -3
date -u
