"""Write ``docs/performance.md`` from the JSON that ``run_gpu.sh`` leaves in ``$OUT``.

    python benchmarks/perf_doc.py --out docs/performance.md "after=OUT_DIR@COMMIT" ["before=OUT_DIR@COMMIT" ...]

Each run is a directory holding ``stall.json`` and/or ``restore_tmpfs.json``; ``COMMIT`` is the commit
whose code ran. For each benchmark the document gets one headline table (checkpointd beside
``torch.save`` and ``async_save``, every run given side by side) and, per run, the table the benchmark
itself printed, with the card, date and command.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

STALL_ROWS = ("checkpointd", "checkpointd_device", "checkpointd_zstd", "copy_only", "dcp_async", "torch_save", "none")
RESTORE_ROWS = ("raw read x 16 thr", "checkpointd restore_latest", "checkpointd restore_latest, fresh process",
                "checkpointd_hostverify restore_latest", "checkpointd_zstd restore_latest",
                "torch_load + load_state_dict")


def _load(run_dir: str, name: str) -> dict[str, Any] | None:
    path = os.path.join(run_dir, f"{name}.json")
    return json.load(open(path)) if os.path.exists(path) else None


def _stall_headline(runs: list[tuple[str, dict[str, Any]]]) -> list[str]:
    head = "| method | " + " | ".join(f"{label}: stall ms, mean ± 95% CI [min, max]" for label, _ in runs) + " |"
    lines = [head, "|---|" + "---|" * len(runs)]
    for method in STALL_ROWS:
        cells = []
        for _, doc in runs:
            row = next((r for r in doc.get("interleaved", []) if r["method"] == method), None)
            cells.append("-" if row is None else
                         f"{row['mean_ms']:.1f} ± {row['ci95_ms']:.1f} [{row['min_ms']:.1f}, {row['max_ms']:.1f}]")
        lines.append(f"| `{method}` | " + " | ".join(cells) + " |")
    return lines


def _restore_headline(runs: list[tuple[str, dict[str, Any]]]) -> list[str]:
    head = "| method | " + " | ".join(f"{label}: best s (median s), GB/s" for label, _ in runs) + " |"
    lines = [head, "|---|" + "---|" * len(runs)]
    for method in RESTORE_ROWS:
        cells = []
        for _, doc in runs:
            rows = [r for d in doc.get("dirs", []) for r in d.get("rows", [])]
            row = next((r for r in rows if r["method"] == method), None)
            if row is None or not row.get("times_s"):
                cells.append("-")
                continue
            times = sorted(row["times_s"])
            cells.append(f"{times[0]:.3f} ({times[len(times) // 2]:.3f}), {row['GBps']:.1f}")
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="LABEL=OUT_DIR@COMMIT")
    ap.add_argument("--out", default="docs/performance.md")
    args = ap.parse_args()
    parsed = []
    for spec in args.runs:
        label, rest = spec.split("=", 1)
        run_dir, _, commit = rest.partition("@")
        parsed.append((f"{label} ({commit})" if commit else label, run_dir))
    out = ["# Performance", "",
           "Current numbers of the benchmarks in `benchmarks/`, written by `benchmarks/perf_doc.py` from the JSON",
           "of `benchmarks/run_gpu.sh`. Each table gives the runs side by side; the commit in each label is the",
           "code that ran. Absolute times are from the card named under each table.", ""]
    for name, title, headline in (("stall", "Training stall per checkpoint", _stall_headline),
                                  ("restore_tmpfs", "Restore from tmpfs into live CUDA tensors", _restore_headline)):
        runs = [(label, doc) for label, d in parsed if (doc := _load(d, name)) is not None]
        if not runs:
            continue
        out += [f"## {title}", ""] + headline(runs) + [""]
        for label, doc in runs:
            info = doc.get("info", {})
            out += [f"### {label}", "",
                    f"{info.get('device', '?')}, {info.get('cpu_count', '?')} cores, torch {info.get('torch', '?')}, "
                    f"{info.get('date', '?')}; command: `{info.get('command', '?')}`", "",
                    "```", (doc.get("table") or "").strip("\n"), "```", ""]
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(out))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
