set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; nproc
timeout 330 python3 benchmarks/bench_stall.py --state-gb 5 --dir /dev/shm/ckd-bench/stall --json $OUT/stall-s16f-h100-5gb.json 2>&1 | grep -v "stats()\|construction" | grep -v "^   " | grep -v "^\[stall\] [a-z_#]*: {" | tail -18 | cut -c1-250
date -u
