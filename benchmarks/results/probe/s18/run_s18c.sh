python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L
P=CHECKPOINTD_REGISTER_PIECE_MB
timeout 560 python3 benchmarks/bench_stall.py --state-gb 20 --every 100 --ckpts 3 --prefault-gb 40 --methods none,checkpointd@$P=0+CHECKPOINTD_POPULATE_THREADS=1,checkpointd,none --dir /dev/shm/ckd-bench/stall --json $OUT/stall-s18c-20gb.json 2>&1 | grep -v "stats()\|construction" | grep -v "^\[stall\] [a-z_#@=A-Z0-9]*: {" | tail -14 | cut -c1-260
python3 -c "
import json, os
r = json.load(open(os.environ['OUT'] + '/stall-s18c-20gb.json'))
for run in r['runs']:
    st = run.get('step_s') or []
    if not st: continue
    s = sorted(range(1, len(st)), key=lambda j: -st[j])[:4]
    print(run['method'], 'pre', round(run.get('before_first_save_ms', 0), 1), 'stall', [round(x,1) for x in run.get('stall_ms', [])], 'top', [(j+1, round(st[j]*1e3,1)) for j in s], 'prep', (run.get('stats') or {}).get('staging_prepare_secs'))
"
date -u
