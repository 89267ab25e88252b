python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; git log --oneline -1; nproc
timeout 150 python3 .probe/mirror_probe.py 4.83 $OUT/mirror-s19a.json 2>&1 | grep -v '^{' 
date -u
timeout 330 python3 benchmarks/bench_stall.py --state-gb 5 --every 60 --ckpts 4 --prefault-gb 20 --methods none,checkpointd,checkpointd_device,checkpointd,none --dir /dev/shm/ckd-bench/stall --json $OUT/stall-s19a-every60.json 2>&1 | grep -v "stats()\|construction" | grep -v "^\[stall\] [a-z_#@=A-Z0-9]*: {" | tail -22 | cut -c1-260
python3 -c "
import json, os
r = json.load(open(os.environ['OUT'] + '/stall-s19a-every60.json'))
for run in r['runs']:
    st = run['step_s']; s = sorted(range(1, len(st)), key=lambda j: -st[j])[:4]
    print(run['method'], 'pre', round(run.get('before_first_save_ms', 0), 1), 'top steps', [(j+1, round(st[j]*1e3,1)) for j in s], 'prep', (run.get('stats') or {}).get('staging_prepare_secs'), 'wait', (run.get('stats') or {}).get('staging_arena_wait_secs'))
"
date -u
