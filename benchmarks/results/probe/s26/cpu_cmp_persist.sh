# alternate old (b33f50e) and new code: bench_persist --cpu, 1 GB, tmpfs
for i in 1 2 3; do
 for v in old new; do
  if [ $v = old ]; then PP=$PWD/.probe/old/src; else PP=$PWD/src; fi
  PYTHONPATH=$PP timeout 300 /work/venv/bin/python benchmarks/bench_persist.py --cpu --state-gb 1 --dirs /dev/shm/ckd-p --methods raw,checkpointd,checkpointd_recycle --raw-threads max --json /tmp/cmp-$v-$i.json > /dev/null 2>&1
  /work/venv/bin/python - $v $i <<'PY'
import json, sys
d = json.load(open(f"/tmp/cmp-{sys.argv[1]}-{sys.argv[2]}.json"))
out = []
for r in d["dirs"][0]["rows"]:
    if r["method"] in ("checkpointd", "checkpointd_recycle") or "overwrite" in r["method"] or r["method"].startswith("raw 1 file x 2 thr") and "mmap" not in r["method"]:
        ls = (r.get("stats") or {}).get("last_save") or {}
        out.append(f"{r['method'][:22]} {[round(x, 2) for x in r['times_s']]} ret {ls.get('retention_secs', 0):.2f} rec {ls.get('files_recycled')}")
print(sys.argv[1], sys.argv[2], " | ".join(out))
PY
 done
done
