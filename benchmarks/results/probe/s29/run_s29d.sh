python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; nproc; git log --oneline -1 2>/dev/null; git status --short | head; python3 -c "import zlib_ng, zstandard; print('zlib_ng ok')"
mkdir -p $OUT/s29d
rm -rf /dev/shm/ckd*
echo "== bench_restore tmpfs (repeat 5, 3 s settle before each manager-based repetition)"
timeout 280 python3 benchmarks/bench_restore.py --state-gb 5 --dirs /dev/shm/ckd-restore --raw-threads 8,max --repeat 5 --methods raw,raw_cold,checkpointd,checkpointd_cold,checkpointd_phases --json $OUT/s29d/restore-s29d.json > $OUT/s29d/restore-s29d.log 2>&1
echo "exit $?"; grep -A14 "^-- /dev/shm" $OUT/s29d/restore-s29d.log | cut -c1-150
python3 - <<'PY' $OUT/s29d/restore-s29d.json
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["dirs"][0]["rows"]:
    print(f'{r["method"][:45]:45s}', " ".join(f"{t*1e3:.1f}" for t in r.get("times_s", [])))
PY
date -u
rm -rf /dev/shm/ckd*
echo "== cold gap probe (3 rounds: a fresh process per restore, chunks4 / chunks2)"
timeout 150 python3 benchmarks/results/probe/s29/cold_gap_probe.py 3 --json $OUT/s29d/cold-gap-s29d.json > $OUT/s29d/cold-gap-s29d.log 2>&1
echo "exit $?"; tail -9 $OUT/s29d/cold-gap-s29d.log | cut -c1-400
date -u
rm -rf /dev/shm/ckd*
echo "== gap probe, no staging arena, last round under cProfile (4 rounds)"
PROBE_NO_ARENA=1 PROBE_PROFILE=1 timeout 100 python3 benchmarks/results/probe/s29/gap_probe.py 4 --json $OUT/s29d/gap-probe-s29d-prof.json > $OUT/s29d/gap-probe-s29d-prof.log 2>&1
echo "exit $?"; grep -A34 "Ordered by: internal" $OUT/s29d/gap-probe-s29d-prof.log | cut -c1-160
rm -rf /dev/shm/ckd*
date -u
cd $OUT && tar czf s29d.tgz s29d && rm -rf s29d
