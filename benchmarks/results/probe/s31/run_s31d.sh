python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; nproc; python3 -c "import zlib_ng, zstandard, torch; print('zlib_ng ok, torch', torch.__version__, torch.version.cuda)"
mkdir -p $OUT/s31d
P=benchmarks/results/probe/s31
echo "== bench_restore tmpfs with each warm restore's timeline (repeat 5)"
timeout 330 python3 $P/bench_timeline.py --state-gb 5 --dirs /dev/shm/ckd-restore --raw-threads 8,max --repeat 5 --methods raw,checkpointd,checkpointd_parse_after,checkpointd_hostverify,checkpointd_cold --json $OUT/s31d/restore-s31d.json > $OUT/s31d/restore-s31d.log 2>&1
echo "exit $?"; grep -E "^\[timeline\]|^\[restore\]" $OUT/s31d/restore-s31d.log | cut -c1-150
grep -A16 "^-- /dev/shm" $OUT/s31d/restore-s31d.log | cut -c1-170
python3 - <<'PY' $OUT/s31d/restore-s31d.json
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["dirs"][0]["rows"]:
    print(f'{r["method"][:50]:50s}', " ".join(f"{t*1e3:.1f}" for t in r.get("times_s", [])), r.get("error", ""))
PY
rm -rf /dev/shm/ckd*
date -u
cd $OUT && tar czf s31d.tgz s31d && rm -rf s31d
