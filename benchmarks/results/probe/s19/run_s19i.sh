python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; nproc
timeout 420 python3 benchmarks/bench_stall.py --state-gb 5 --every 60 --ckpts 4 --prefault-gb 20 --methods none,checkpointd,checkpointd_device,checkpointd,none --dir /dev/shm/ckd-bench/stall --json $OUT/stall-s19i-h100-every60.json 2>&1 | grep -v "stats()\|construction" | grep -v "^\[stall\] [a-z_#@=A-Z0-9]*: {" | tail -16 | cut -c1-260
python3 -c "
import json, os
r = json.load(open(os.environ['OUT'] + '/stall-s19i-h100-every60.json'))
for run in r['runs']:
    st = run['step_s']; med = run.get('none_median_step_ms') or run.get('median_step_ms')
    pre = sorted([(j+1, round(st[j]*1e3-med,1)) for j in range(1, 58)], key=lambda p: -p[1])[:4]
    s = run.get('stats') or {}
    print(run['method'], 'pre', round(run.get('before_first_save_ms', 0), 1), 'top pre', pre, 'prep', s.get('staging_prepare_secs'), 'wait', s.get('staging_arena_wait_secs'), 'block', [round(b*1e3,1) for b in (run.get('block_s') or [])[:4]])
"
date -u
