set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; nproc
timeout 170 python3 benchmarks/bench_persist.py --state-gb 5 --dirs /dev/shm/ckd-persist --methods raw,checkpointd,checkpointd_recycle --raw-threads 8,max --repeat 2 --rounds 2 --json $OUT/persist-s17d-keep.json 2>&1 | tail -12 | cut -c1-300
date -u
CHECKPOINTD_KEEP_MAPPINGS=0 timeout 130 python3 benchmarks/bench_persist.py --state-gb 5 --dirs /dev/shm/ckd-persist --methods raw,checkpointd_recycle --raw-threads max --repeat 2 --rounds 2 --json $OUT/persist-s17d-nokeep.json 2>&1 | tail -8 | cut -c1-300
date -u
