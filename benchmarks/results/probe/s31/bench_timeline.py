"""Session 31 probe: ``bench_restore.py`` as it is, with session 31's timeline of every warm restore.

Why: in s31c the benchmark's GPU-verified warm row took 396-638 ms while ``restore_ab.py``'s warm
restores in the same lease took 170-232. This runs bench_restore's main() unchanged (same arguments),
with the library steps wrapped as in ``restore_ab.py``, and prints each ``restore_latest`` call of this
process (the warm rows; the fresh-process rows run in children) as a timeline, tagged with the
environment that the row set (``CHECKPOINTD_RESTORE_VERIFY``, ``CHECKPOINTD_RESTORE_PARSE_IN_WAIT``,
``CHECKPOINTD_RESTORE_SWITCH_INTERVAL_SECS``).

Run: python benchmarks/results/probe/s31/bench_timeline.py <bench_restore.py arguments>
"""

from __future__ import annotations

import functools
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import restore_ab as A  # noqa: E402  (its import puts benchmarks/ on the path)


def main() -> None:
    A.instrument()
    import checkpointd.manager as M

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
                           ("CHECKPOINTD_RESTORE_VERIFY", "CHECKPOINTD_RESTORE_PARSE_IN_WAIT",
                            "CHECKPOINTD_RESTORE_SWITCH_INTERVAL_SECS") if k in os.environ)
            print(f"\n[timeline] restore_latest {total * 1e3:.1f} ms {tag or '(defaults)'}", flush=True)
            print("\n".join(A.timeline(t0, list(A.events))), flush=True)

    M.CheckpointManager.restore_latest = restore_latest
    import bench_restore as B

    sys.argv = [os.path.join(HERE, "..", "..", "..", "bench_restore.py")] + sys.argv[1:]
    B.main()


if __name__ == "__main__":
    main()
