python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; nproc
P=CHECKPOINTD_REGISTER_PIECE_MB
timeout 400 torchrun --nproc_per_node=2 benchmarks/bench_stall_dist.py --state-gb 5 --every 100 --ckpts 3 --prefault-gb 20 \
  --methods none,checkpointd@$P=0+CHECKPOINTD_POPULATE_THREADS=1,checkpointd,none --dir /dev/shm/ckd-dist --json $OUT/stall-dist-s18e.json 2>&1 | grep -v "^W11\|OMP_NUM\|\*\*\*\*\|^\[stall-dist\] " | grep -v "stats()\|construction" | tail -24 | cut -c1-220
python3 -c "
import json, os
r = json.load(open(os.environ['OUT'] + '/stall-dist-s18e.json'))
for k, rank in enumerate(r['ranks']):
    for run in rank['runs']:
        st = run.get('step_s') or []
        s = sorted(range(1, len(st)), key=lambda j: -st[j])[:3]
        print('rank', k, run['method'], 'pre', round(run.get('before_first_save_ms', 0), 1), 'stall', [round(x,1) for x in run.get('stall_ms', [])], 'top', [(j+1, round(st[j]*1e3,1)) for j in s], 'prep', (run.get('stats') or {}).get('staging_prepare_secs'))
"
date -u
