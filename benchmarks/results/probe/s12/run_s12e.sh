set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L
timeout 150 python3 benchmarks/diagnose_thread_cpu.py --state-gb 0.5 --saves 10 --every 30 --dir /dev/shm/ckd-tc --json $OUT/thread-cpu-s12e-05gb.json 2>&1 | grep "^{" | cut -c1-400
date -u
