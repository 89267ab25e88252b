"""Session 34 probe: session 31's timeline probe with the native upload's call timed too.

Runs ``bench_restore.py`` unchanged (same arguments) with the library steps wrapped as in session 31's
``restore_ab.py`` plus ``upload_native.upload_pairs`` ("native_upload"; ``upload_tensor`` in s34a's library), and prints each warm
``restore_latest`` as a timeline tagged with ``CHECKPOINTD_RESTORE_UPLOAD`` / ``_VERIFY`` where a row set them.

Run: python benchmarks/results/probe/s34/bench_timeline.py <bench_restore.py arguments>
"""

from __future__ import annotations

import functools
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "s31"))
import restore_ab as A  # noqa: E402  (its import puts benchmarks/ on the path)


def main() -> None:
    A.instrument()
    from checkpointd import upload_native
    import checkpointd.manager as M

    A.timed(upload_native, "upload_tensor" if hasattr(upload_native, "upload_tensor") else "upload_pairs", "native_upload")
    real = M.CheckpointManager.restore_latest

    @functools.wraps(real)
    def restore_latest(self, *a, **k):
        with A.lock:
            A.events.clear()
        t0 = time.perf_counter()
        try:
            return real(self, *a, **k)
        finally:
            total = time.perf_counter() - t0
            tag = " ".join(f"{k.split('CHECKPOINTD_RESTORE_')[1]}={os.environ[k]}" for k in
                           ("CHECKPOINTD_RESTORE_VERIFY", "CHECKPOINTD_RESTORE_UPLOAD") if k in os.environ)
            print(f"\n[timeline] restore_latest {total * 1e3:.1f} ms {tag or '(defaults)'}", flush=True)
            print("\n".join(A.timeline(t0, list(A.events))), flush=True)

    M.CheckpointManager.restore_latest = restore_latest
    import bench_restore as B

    sys.argv = [os.path.join(HERE, "..", "..", "..", "bench_restore.py")] + sys.argv[1:]
    B.main()


if __name__ == "__main__":
    main()
