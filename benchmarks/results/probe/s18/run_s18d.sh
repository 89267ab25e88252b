python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L
P=CHECKPOINTD_REGISTER_PIECE_MB; Q=CHECKPOINTD_REGISTER_PAUSE
timeout 420 python3 benchmarks/bench_stall.py --state-gb 20 --every 80 --ckpts 2 --prefault-gb 20 --methods none,checkpointd@$Q=3,checkpointd@$P=64+$Q=3,checkpointd,none --dir /dev/shm/ckd-bench/stall --json $OUT/stall-s18d-20gb-pause.json 2>&1 | grep -v "stats()\|construction" | grep -v "^\[stall\] [a-z_#@=A-Z0-9]*: {" | tail -12 | cut -c1-230
python3 -c "
import json, os
r = json.load(open(os.environ['OUT'] + '/stall-s18d-20gb-pause.json'))
runs = r['runs']; base = [(a + b) / 2 for a, b in zip(runs[0]['step_s'], runs[-1]['step_s'])]
for run in runs:
    st = run.get('step_s') or []
    print(run['method'], 'pre', round(run.get('before_first_save_ms', 0), 1), 'stall', [round(x,1) for x in run.get('stall_ms', [])], 'prep', (run.get('stats') or {}).get('staging_prepare_secs'))
    print('   ', ' '.join(f'{1e3*(st[j]-base[j]):.0f}' for j in range(min(79, len(st)))))
"
date -u
