"""Per rank of a bench_stall_dist JSON: the first save's write seconds and files recycled, the last save's."""
import json, sys
for f in sys.argv[1:]:
    d = json.load(open(f))
    for rank, rr in enumerate(d["ranks"]):
        for r in rr["runs"]:
            if not r["method"].startswith("checkpointd"):
                continue
            a = (r.get("stats_after_first_save") or {}).get("last_save", {})
            b = (r.get("stats") or {}).get("last_save", {})
            print(f"{f.split('/')[-1]} r{rank} {r['method']}: first save write {a.get('write_secs', float('nan')):.3f} s,"
                  f" files {a.get('files_recycled')}/{a.get('files')} recycled; last save (step {b.get('step')}) write"
                  f" {b.get('write_secs', float('nan')):.3f} s, files {b.get('files_recycled')}/{b.get('files')}; median {r.get('median_step_ms', 0):.1f}")
