python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; git log --oneline -1
timeout 200 python3 -m pytest -q tests/gpu tests/test_persist_process.py tests/test_recycle.py tests/test_host_budget.py tests/test_early_writeback.py tests/test_snapshot.py tests/test_pagemem.py tests/test_fast_restore.py -p no:cacheprovider 2>&1 | tail -4
date -u
P=CHECKPOINTD_REGISTER_PIECE_MB
timeout 370 python3 benchmarks/bench_stall.py --state-gb 5 --every 100 --ckpts 3 --prefault-gb 20 --step-counters --methods none,checkpointd@$P=0,checkpointd,checkpointd@$P=64,checkpointd@CHECKPOINTD_REGISTER_PAUSE=0,checkpointd@CHECKPOINTD_POPULATE_THREADS=4,none --dir /dev/shm/ckd-bench/stall --json $OUT/stall-s18a-pieces.json 2>&1 | grep -v "stats()\|construction" | grep -v "^\[stall\] [a-z_#@=A-Z0-9]*: {" | tail -22 | cut -c1-260
python3 -c "
import json, os
r = json.load(open(os.environ['OUT'] + '/stall-s18a-pieces.json'))
for run in r['runs']:
    st = run['step_s']; s = sorted(range(1, len(st)), key=lambda j: -st[j])[:4]
    print(run['method'], 'pre', round(run.get('before_first_save_ms', 0), 1), 'top steps', [(j+1, round(st[j]*1e3,1)) for j in s], 'prep', (run.get('stats') or {}).get('staging_prepare_secs'))
"
date -u
