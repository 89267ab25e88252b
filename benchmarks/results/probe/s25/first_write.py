"""Per rank and run of a bench_stall_dist JSON: the first save's write seconds, stall mean [first], median step."""
import json, sys
for f in sys.argv[1:]:
    d = json.load(open(f))
    for rank, rr in enumerate(d["ranks"]):
        for r in rr["runs"]:
            if not r["method"].startswith("checkpointd"):
                print(f"{f.split('/')[-1]} r{rank} {r['method']:<14} median {r.get('median_step_ms', 0):.1f}")
                continue
            ls = (r.get("stats_after_first_save") or {}).get("last_save", {})
            st = r.get("stall_ms") or []
            print(f"{f.split('/')[-1]} r{rank} {r['method']:<14} first-save write {ls.get('write_secs', float('nan')):.3f} s"
                  f" ({ls.get('bytes_written', 0)/1e9:.2f} GB); stall mean {sum(st)/max(1,len(st)):.1f} first {st[0] if st else float('nan'):.1f}"
                  f" local {r.get('stall_local_ms') and sum(r['stall_local_ms'])/len(r['stall_local_ms']):.1f}; median {r.get('median_step_ms', 0):.1f}")
