"""Recycled files in sharded mode (two ranks, FSDP2): rank 0's retention retires every rank's files,
each rank's next save takes one from the shared bin, and every checkpoint still restores bit-exact.

``CHECKPOINTD_TEST_BACKEND=nccl`` runs it on two GPUs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

from dist_harness import assert_same_state, fsdp2_with_adamw, gathered_state, run_distributed, train_same_batches
from tree_compare import big_files

from checkpointd.storage import recyclebin
from checkpointd import CheckpointManager, DistributedOptions, StagingOptions

pytestmark = pytest.mark.skipif(recyclebin.F_SETLEASE is None, reason="needs Linux leases (F_SETLEASE)")

WIDTH = 2560  # a rank's shard of the model: 2 x 2560^2 / 2 fp32 = 26 MB, its AdamW state twice that


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(WIDTH, WIDTH, bias=False)
        self.b = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _inodes(root: str) -> dict[str, int]:
    """Inode of every recyclable file under ``root`` (step directories and bin), by relative path."""
    return {k: st.st_ino for k, st in big_files(root).items()}


def sharded_recycling(rank: int, world: int, root: str, write_mode: str = "auto", budget: int | None = None) -> Any:
    import torch.distributed as dist

    from checkpointd.save import snapshot
    from checkpointd.storage import filesahead, persist_process, writemode

    writemode.WRITE_MODE = write_mode  # set in the rank's process: a forkserver child imports checkpointd afresh
    filesahead.FILES_AHEAD_SETS = 0  # the bin holds retired files only (files made ahead: test_recycle.py)
    snapshot.STREAM_CPU_TENSORS = budget is not None  # CPU shards through the host budget's ring, as CUDA ones
    model, opt = fsdp2_with_adamw(_Net, seed=0)
    seen = []
    with CheckpointManager(root, {"model": model, "optim": opt}, mode="sharded", compression=None,
                           keep_last=1, every_n_steps=1, distributed=DistributedOptions(timeout_secs=30),
                           staging=StagingOptions(host_budget_bytes=budget)) as mgr:
        for step in range(4):
            train_same_batches(model, opt, 1, seed=step, features=WIDTH)
            mgr.save(step)
            mgr.wait()  # committed, retention applied (by rank 0)
            dist.barrier()
            seen.append(_inodes(root) if rank == 0 else None)
            dist.barrier()
        want = gathered_state(model, opt)
    fresh, fresh_opt = fsdp2_with_adamw(_Net, seed=1)
    with CheckpointManager(root, {"model": fresh, "optim": fresh_opt}, mode="sharded", distributed=DistributedOptions(timeout_secs=30)) as mgr:
        restored = mgr.restore_latest()
    assert restored == 3
    assert_same_state(gathered_state(fresh, fresh_opt), want)
    dist.barrier()
    left = sorted(os.listdir(root)) if rank == 0 else None
    process = persist_process.client()
    return seen, left, process.writes_done if process is not None else 0


@pytest.mark.parametrize("write_mode", ["auto", "mmap"])
def test_sharded_saves_write_over_every_ranks_retired_files(tmp_path: Path, write_mode: str) -> None:
    """``mmap``: files filled through mappings, as on tmpfs. Two ranks on one host: their persist
    processes keep no mappings (rank 0 could not ask rank 1's whether a file is in use)."""
    (seen, left, _), _ = run_distributed(sharded_recycling, 2, str(tmp_path), write_mode, deadline_secs=120)
    _check_recycling(seen, left)


def test_sharded_host_budget_streams_each_rank_through_its_persist_process(tmp_path: Path) -> None:
    """Under a host budget each rank's ring is written by that rank's persist process (chunk by chunk:
    many requests a save), over retired files as without a budget, and restores bit-exact."""
    results = run_distributed(sharded_recycling, 2, str(tmp_path), "auto", 8 << 20, deadline_secs=150)
    (seen, left, _), _ = results
    _check_recycling(seen, left)
    for _, _, writes in results:
        assert writes >= 4 * 10  # four saves of ~80 MB a rank through 2 MiB chunks


def first_saves_into_files_made_ahead(rank: int, world: int, root: str) -> Any:
    import time

    import torch.distributed as dist

    from checkpointd.storage import filesahead

    filesahead.FILES_AHEAD_SETS = 2
    model, opt = fsdp2_with_adamw(_Net, seed=0)
    train_same_batches(model, opt, 1, seed=0, features=WIDTH)  # the optimizer's state exists: one file size
    with CheckpointManager(root, {"model": model, "optim": opt}, mode="sharded", compression=None,
                           keep_last=1, every_n_steps=1, distributed=DistributedOptions(timeout_secs=30)) as mgr:
        assert mgr.restore_latest() is None  # the staging buffers, then this rank's blank files
        deadline = time.monotonic() + 60
        while len(mgr._files_ahead.made) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        made = list(mgr._files_ahead.made)
        dist.barrier()
        blank = _inodes(root) if rank == 0 else None
        dist.barrier()
        recycled = []
        for step in range(2):
            train_same_batches(model, opt, 1, seed=step + 1, features=WIDTH)
            mgr.save(step)
            mgr.wait()
            recycled.append(mgr.stats()["last_save"]["files_recycled"])  # this rank's files
            dist.barrier()
        written = _inodes(root) if rank == 0 else None
        dist.barrier()
        want = gathered_state(model, opt)
    fresh, fresh_opt = fsdp2_with_adamw(_Net, seed=1)
    with CheckpointManager(root, {"model": fresh, "optim": fresh_opt}, mode="sharded", distributed=DistributedOptions(timeout_secs=30)) as mgr:
        assert mgr.restore_latest() == 1
    assert_same_state(gathered_state(fresh, fresh_opt), want)
    return made, blank, written, recycled


def test_every_rank_of_a_host_writes_its_first_saves_into_files_made_ahead(tmp_path: Path) -> None:
    """Two ranks on one host share the bin: each makes blank files for its first two saves (not only
    the first rank to start), and the two saves of both ranks take all four."""
    results = run_distributed(first_saves_into_files_made_ahead, 2, str(tmp_path), deadline_secs=120)
    (made0, blank, written, recycled0), (made1, _, _, recycled1) = results
    assert len(made0) == 2 and len(made1) == 2  # each rank: one shard file a save, two saves
    assert recycled0 == recycled1 == [1, 1]  # stats() of each rank: its shard file written over a blank one
    blank_inodes = {v for k, v in blank.items() if k.startswith(recyclebin.BIN_NAME)}
    assert len(blank_inodes) == 4 and not any(k.startswith("step-") for k in blank)
    saved = {v for k, v in written.items() if k.startswith("step-")}
    assert len(saved) == 2  # keep_last=1: step 1's two shard files (step 0's retired into the bin)
    assert saved <= blank_inodes  # both ranks' second saves wrote over blank files
    first = {v for k, v in written.items() if k.startswith(recyclebin.BIN_NAME)}
    assert first == blank_inodes - saved  # step 0's, retired, are the other two blank files


def _check_recycling(seen: list[dict[str, int]], left: list[str]) -> None:
    by_step = [{v for k, v in s.items() if k.startswith("step-")} for s in seen]
    binned = [{v for k, v in s.items() if k.startswith(recyclebin.BIN_NAME)} for s in seen]
    assert len(by_step[0]) == 2  # one shard file a rank
    assert binned[0] == set() and binned[1] == by_step[0]  # step 0 retired after step 1 committed
    assert by_step[2] == by_step[0] and by_step[3] == by_step[1]  # each rank took a retired file
    assert left == ["step-000000003"]  # close() emptied the bin
