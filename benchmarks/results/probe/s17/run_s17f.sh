python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L
timeout 115 python3 benchmarks/bench_stall.py --state-gb 5 --every 100 --ckpts 3 --prefault-gb 20 --methods none,checkpointd,checkpointd_device --dir /dev/shm/ckd-bench/stall --json $OUT/stall-s17f-every100.json 2>&1 | grep -v "stats()\|construction" | grep -v "^\[stall\] [a-z_#@=A-Z0-9]*: {" | tail -5 | cut -c1-200
python3 -c "
import json, os
r = json.load(open(os.environ['OUT'] + '/stall-s17f-every100.json'))
for run in r['runs']:
    st = run['step_s']; print(run['method'], 'steps 1-3', [round(x*1e3,1) for x in st[:3]], 'max', round(max(st)*1e3,1), 'at', st.index(max(st))+1, 'block', [round(x*1e3,1) for x in run['block_s']])
"
date -u
