set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; nproc
timeout 200 python3 -m pytest -q tests/gpu tests/test_persist_process.py tests/test_recycle.py tests/test_host_budget.py tests/test_early_writeback.py tests/test_snapshot.py tests/test_pagemem.py tests/test_fast_restore.py -p no:cacheprovider 2>&1 | tail -3
date -u
P=@CHECKPOINTD_POPULATE_STAGING=0
M=none,checkpointd,checkpointd$P,checkpointd_device,checkpointd_device$P,none
timeout 240 python3 benchmarks/bench_stall.py --state-gb 5 --every 60 --ckpts 4 --step-counters --methods $M --dir /dev/shm/ckd-bench/stall --json $OUT/stall-s17e-populate.json 2>&1 | grep -v "stats()\|construction" | grep -v "^\[stall\] [a-z_#@=A-Z0-9]*: {" | grep -v "^   [a-z_#@=A-Z0-9]*: [0-9]* steps >" | tail -9 | cut -c1-250
python3 - <<'PY'
import json, os
r = json.load(open(os.environ["OUT"] + "/stall-s17e-populate.json"))
for run in r["runs"]:
    st = run["step_s"]
    print(run["method"], "steps 1-3 ms", [round(x * 1e3, 1) for x in st[:3]], "max", round(max(st) * 1e3, 1), "at", st.index(max(st)) + 1)
PY
date -u
