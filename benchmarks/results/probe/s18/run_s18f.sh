python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; nproc
timeout 200 python3 -m pytest -q tests/gpu tests/test_persist_process.py tests/test_recycle.py tests/test_host_budget.py tests/test_early_writeback.py tests/test_snapshot.py tests/test_pagemem.py tests/test_fast_restore.py -p no:cacheprovider 2>&1 | tail -3
date -u
timeout 260 python3 benchmarks/bench_stall.py --state-gb 5 --every 60 --ckpts 4 --prefault-gb 20 --methods none,dcp_async,checkpointd,checkpointd_device,none --dir /dev/shm/ckd-bench/stall --json $OUT/stall-s18f-h100.json 2>&1 | grep -v "stats()\|construction" | grep -v "^\[stall\] [a-z_#@=A-Z0-9]*: {" | tail -12 | cut -c1-250
python3 -c "
import json, os
r = json.load(open(os.environ['OUT'] + '/stall-s18f-h100.json'))
for run in r['runs']:
    st = run.get('step_s') or []
    if not st: continue
    s = sorted(range(1, len(st)), key=lambda j: -st[j])[:4]
    print(run['method'], 'pre', round(run.get('before_first_save_ms', 0), 1), 'stall', [round(x,1) for x in run.get('stall_ms', [])], 'top', [(j+1, round(st[j]*1e3,1)) for j in s], 'block', [round(x*1e3,1) for x in run['block_s']])
"
date -u
