"""Run callables on a thread pool, at most ``lanes`` at a time, results in order; and how many ranks
share this host's cores (:func:`local_ranks`), which sizes every pool of threads the library starts.

Why a module of its own: the persist process (:mod:`checkpointd.storage.persist_process_main`) loads it by
path, without the package (which imports torch), and :mod:`checkpointd.storage.ptlayout` imports it; so it
uses the standard library only.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any


def run_in_lanes(fns: list[Callable[[], Any]], pool: Executor, lanes: int) -> list[Any]:
    """Each of ``lanes`` pool tasks runs the next of ``fns`` until none is left; results in order.

    Several callers thereby share one pool instead of the first queueing all of its work ahead of the
    others. After a failure no further callable starts; every lane is waited for, then the first
    failure is raised.
    """
    results: list[Any] = [None] * len(fns)
    lock = threading.Lock()
    state = {"next": 0, "failed": False}

    def lane() -> None:
        while True:
            with lock:
                i = state["next"]
                if i >= len(fns) or state["failed"]:
                    return
                state["next"] = i + 1
            try:
                results[i] = fns[i]()
            except BaseException:
                state["failed"] = True
                raise

    futures = [pool.submit(lane) for _ in range(max(1, min(lanes, len(fns))))]
    error: BaseException | None = None
    for f in futures:
        try:
            f.result()
        except BaseException as exc:  # noqa: BLE001 - keep the first, wait for every lane
            error = error or exc
    if error is not None:
        raise error
    return results


def local_ranks() -> int:
    """Ranks on this host (``LOCAL_WORLD_SIZE``, set by ``torchrun``; 1 without it or when unreadable).

    Each rank starts its own threads (I/O, persist process, page population): dividing by this keeps
    a host of several ranks from running several times as many threads as it has cores.
    """
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


__all__ = ["local_ranks", "run_in_lanes"]
