python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L
T=CHECKPOINTD_POPULATE_THREADS
timeout 420 python3 benchmarks/bench_stall.py --state-gb 5 --every 60 --ckpts 4 --prefault-gb 20 --methods none,dcp_async,torch_save,checkpointd,checkpointd@$T=1,checkpointd_device,checkpointd_device@$T=1,none --dir /dev/shm/ckd-bench/stall --json $OUT/stall-s18b-every60.json 2>&1 | grep -v "stats()\|construction" | grep -v "^\[stall\] [a-z_#@=A-Z0-9]*: {" | tail -19 | cut -c1-260
python3 -c "
import json, os
r = json.load(open(os.environ['OUT'] + '/stall-s18b-every60.json'))
for run in r['runs']:
    st = run.get('step_s') or []
    if not st: continue
    s = sorted(range(1, len(st)), key=lambda j: -st[j])[:4]
    print(run['method'], 'pre', round(run.get('before_first_save_ms', 0), 1), 'stall', [round(x,1) for x in run.get('stall_ms', [])], 'top', [(j+1, round(st[j]*1e3,1)) for j in s], 'block', [round(x*1e3,1) for x in run['block_s']])
"
date -u
