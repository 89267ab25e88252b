"""Coordination between ranks on dedicated gloo groups, and the distributed commit protocol.

Why dedicated groups: the committer thread runs while the training thread issues its own collectives
(NCCL all-reduces, FSDP all-gathers). Collectives of two threads on one group interleave differently on
different ranks and deadlock. So the manager creates, collectively at construction, two gloo groups of
its own:

- ``control``: used only on the training thread (schedule decisions, restore agreement);
- ``commit``: used only on the committer thread (the protocol below).

The commit protocol of one save, on every rank's committer thread, in step order:

1. the planning steps (``BackgroundWriter.plan_job``, ``prepare_files``: rank 0 also clears a leftover
   step directory; a job abandoned on this rank raises its ``failure``), then an all-gather of "ready" with
   each rank's step: nobody writes into the directory before rank 0 cleared it, and ranks that hand
   different steps to the protocol (a rank's ``maybe_save`` raised after the ranks agreed to save) all
   fail that save instead of writing one step's files under another's manifest;
2. each rank writes its own files, then an all-gather of (ok or error, FileEntry list, block records);
3. rank 0, if every rank is ok, writes ``manifest.json`` listing every rank's files and then
   ``COMMITTED`` (IMPORTANT: only after every rank reported its files durable), applies retention,
   and broadcasts the outcome;
4. every rank's job ends with that outcome: success, or the first failure (naming the rank), which the
   manager raises as CheckpointWriteError at the next ``maybe_save``/``wait``/``close``.

A rank that dies or never reaches the protocol makes the others fail at the group timeout
(``DistributedOptions.timeout_secs``), not hang forever.

Before any of that, on the training thread, :meth:`Coordinator.settle` makes a save that fails on one
rank (bad state) fail on every rank in the same ``maybe_save`` call: one all-reduce of three integers
on ``control`` per check; only when a rank failed or the steps differ do the ranks exchange messages.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import asdict
from datetime import timedelta
from concurrent.futures import Future
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from checkpointd import commit
from checkpointd.format import layout
from checkpointd.errors import CheckpointError, StateError
from checkpointd.format.manifest import Manifest
from checkpointd.save import planning
from checkpointd.save.job import SaveJob
from checkpointd.save.writer import BackgroundWriter

logger = logging.getLogger("checkpointd")


class RankFailedError(CheckpointError):
    """A save failed on one or more ranks (or the ranks could not coordinate); nothing was committed."""


class PeerStateError(RankFailedError, StateError):
    """Another rank's registered state cannot be saved; this rank's ``maybe_save`` raises it too."""


Failure = tuple[int, int, tuple[bool, str] | None]
"""One rank's part of a failed :meth:`Coordinator.settle`: (rank, step, (is a StateError, message) or None)."""


class Coordinator:
    """This process's rank, the world size and the manager's two gloo groups.

    Construction is collective: every rank must build its manager in the same order.
    """

    def __init__(self, timeout_secs: float = 600.0) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise CheckpointError("torch.distributed is not initialized")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.timeout_secs = float(timeout_secs)
        timeout = timedelta(seconds=self.timeout_secs)
        self.control = dist.new_group(backend="gloo", timeout=timeout)
        self.commit = dist.new_group(backend="gloo", timeout=timeout)

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    @contextlib.contextmanager
    def _coordinating(self, what: str) -> Iterator[None]:
        """Turn a failed collective on the training thread into a CheckpointError that says what to check."""
        try:
            yield
        except RuntimeError as exc:  # gloo timeouts and closed connections (DistError derives from it)
            raise RankFailedError(
                f"rank {self.rank}: {what} with the other ranks failed: {exc}. A rank died, hangs, or did not call "
                f"maybe_save/restore with the same steps within DistributedOptions.timeout_secs={self.timeout_secs:g}") from exc

    def all_gather(self, obj: Any, *, group: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=group)
        return out

    def broadcast(self, obj: Any, *, group: Any) -> Any:
        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=group)
        return box[0]

    def agree(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (training thread only)."""
        with self._coordinating("agreeing on rank 0's decision"):
            return self.broadcast(value, group=self.control)

    def gather_control(self, value: Any) -> list[Any]:
        """Every rank's ``value`` on every rank (training thread only)."""
        with self._coordinating("exchanging results"):
            return self.all_gather(value, group=self.control)

    def settle(self, step: int, error: BaseException | None) -> list[Failure]:
        """Whether every rank got through one part of the save of ``step`` (training thread only).

        Returns [] when every rank passed ``error=None`` with the same ``step``; otherwise every rank
        gets every rank's (rank, step, error description), the same list on each. Costs one all-reduce
        of three integers; the all-gather of the descriptions runs only when something failed.
        """
        flags = torch.tensor([int(error is not None), step, -step], dtype=torch.int64)
        with self._coordinating(f"checking that the save of step {step} succeeded on every rank"):
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.control)
        failed, highest, lowest = int(flags[0]), int(flags[1]), -int(flags[2])
        if not failed and highest == lowest:
            return []
        mine = None if error is None else (isinstance(error, StateError), _describe(error))
        reports = self.gather_control((step, mine))
        return [(r, s, e) for r, (s, e) in enumerate(reports)]

    def close(self) -> None:
        for g in (self.control, self.commit):
            try:
                dist.destroy_process_group(g)
            except Exception:  # noqa: BLE001 - the default group may already be gone
                pass


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class DistributedWriter(BackgroundWriter):
    """The BackgroundWriter whose ``_process`` runs the commit protocol of the module docstring.

    Args:
        merge_manifest: rank 0 only: (job, per-rank reports) -> the manifest to write.
        hooks: ``clear_step_dir``, ``on_commit``, ``after_save`` of :class:`BackgroundWriter`; rank 0 runs
            ``on_commit`` before the others learn the outcome, the others after it.
    """

    def __init__(self, store: Any, codec: Any, coordinator: Coordinator, file_threads: int,
                 merge_manifest: Callable[[SaveJob, list[dict[str, Any]]], Any], **hooks: Any) -> None:
        self.coord = coordinator
        self.merge_manifest = merge_manifest
        super().__init__(store, codec, file_threads=file_threads, **hooks)

    def abandon(self, step: int, error: BaseException) -> Future:
        """Take part in the commit protocol of ``step`` reporting ``error``; returns that job's future (it fails).

        For a ``maybe_save`` that raised on this rank after the ranks agreed to save ``step`` (its staging
        failed, say): the other ranks' save of ``step`` then fails at once, naming this rank and ``error``,
        instead of pairing with this rank's next save (which the step check of the protocol refuses).
        """
        manifest = Manifest(step=step, time=time.time(), world_size=self.coord.world_size, mode="", codec="",
                            library_version="", torch_version="")
        return self.submit(SaveJob(step=step, step_dir=layout.step_dir_name(step), manifest=manifest, failure=error))

    def _process(self, job: SaveJob) -> None:
        coord, group = self.coord, self.coord.commit
        error: BaseException | None = None
        try:
            self.stage(job)
        except BaseException as exc:  # noqa: BLE001 - must still take part in the protocol
            error = exc
        ready = coord.all_gather((job.step, None if error is None else _describe(error)), group=group)
        if len({s for s, _ in ready}) > 1 and error is None:
            error = RankFailedError(f"the ranks handed different steps to the commit protocol "
                                    f"({', '.join(f'rank {r}: step {s}' for r, (s, _) in enumerate(ready))}): a rank's "
                                    "maybe_save raised after the ranks agreed to save; every rank must save the same steps")
        if error is None and all(e is None for _, e in ready):
            error = self.write_files(job)
        else:
            planning.release_staging(job)
        entries = job.manifest.files
        t2 = time.perf_counter()
        report = {"rank": coord.rank, "error": None if error is None else _describe(error),
                  "files": [asdict(e) for e in entries], "extra": job.manifest.extra.get("_rank_local")}
        reports = coord.all_gather(report, group=group)
        failures = [f"rank {r['rank']}: {r['error']}" for r in reports if r["error"] is not None]
        outcome: dict[str, Any] | None = None
        if coord.is_rank0:
            outcome = self._commit_on_rank0(job, reports, failures)
        outcome = coord.broadcast(outcome, group=group)
        job.timings["commit_secs"] = time.perf_counter() - t2
        if not outcome["ok"]:
            raise RankFailedError(f"step {job.step} was not committed: {outcome['error']}") from error
        if not coord.is_rank0 and self.on_commit is not None:
            self.on_commit(job)

    def _commit_on_rank0(self, job: SaveJob, reports: list[dict[str, Any]], failures: list[str]) -> dict[str, Any]:
        if failures:
            logger.error("checkpointd: step %d not committed: %s", job.step, "; ".join(failures))
            return {"ok": False, "error": "; ".join(failures)}
        try:
            manifest = self.merge_manifest(job, reports)
            # IMPORTANT: commit only after every rank reported its files durable (reports above).
            self._call(commit.write_manifest_and_commit, self.store, job.step_dir, manifest, self.before_marker)
            job.manifest = manifest
        except BaseException as exc:  # noqa: BLE001
            return {"ok": False, "error": f"rank 0 could not commit: {_describe(exc)}"}
        t = time.perf_counter()
        if self.on_commit is not None:
            try:
                self.on_commit(job)  # retention, before the others learn the outcome
            except Exception as exc:  # noqa: BLE001 - a committed save stays committed
                logger.warning("checkpointd: after-commit of step %d failed: %s", job.step, exc)
        job.timings["retention_secs"] = time.perf_counter() - t
        return {"ok": True, "error": None}
