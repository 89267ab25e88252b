"""The distributed harness itself: a rank that dies in C or hangs is reported with its own evidence.

A failure seen only in CI (a rank killed by SIGABRT, no traceback) is otherwise undiagnosable; these
tests make sure the harness quotes what the dying rank printed and every thread's stack.
"""

from __future__ import annotations

import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from dist_harness import DistributedFailure, run_distributed


def abort_on_rank1(rank: int, world: int) -> Any:
    if rank == 1:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file in the test's directory
        print("rank 1 is about to abort", file=sys.stderr, flush=True)
        os.abort()
    return rank


def ready(rank: int, world: int) -> Any:
    return rank


def hang_on_rank1(rank: int, world: int, root: str) -> Any:
    """Rank 1 hangs with a manager open that took SIGUSR1 (its preemption signal) for itself."""
    import torch

    from checkpointd import CheckpointManager, DistributedOptions

    with CheckpointManager(root, {"m": torch.nn.Linear(2, 2)}, save_on_signals=True, distributed=DistributedOptions(timeout_secs=30)):
        if rank == 1:  # construction was collective; closing is not
            time.sleep(120)
    return rank


def test_a_rank_killed_by_sigabrt_is_quoted_with_its_stack() -> None:
    with pytest.raises(DistributedFailure) as info:
        run_distributed(abort_on_rank1, 2)
    text = str(info.value)
    assert "rank 1: exited with code -6" in text
    assert "rank 1 is about to abort" in text
    assert "Fatal Python error: Aborted" in text
    assert "abort_on_rank1" in text  # the Python frame that was running
    assert "rank 0" not in text  # rank 0 finished; it is not blamed


def test_a_hung_rank_is_killed_with_every_threads_stack(tmp_path: Path) -> None:
    assert run_distributed(ready, 2) == [0, 1]  # the forkserver is up: the deadline below is the rank's own
    with pytest.raises(DistributedFailure) as info:
        run_distributed(hang_on_rank1, 2, str(tmp_path), deadline_secs=12)
    text = str(info.value)
    assert "ranks [1] were killed" in text
    assert "rank 1: killed at the deadline" in text
    assert "hang_on_rank1" in text
