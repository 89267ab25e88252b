"""The checkpoint roots one :class:`checkpointd.CheckpointManager` writes, and what it knows of them.

A manager commits on one root (``root``, or ``local_dir`` with two tiers, whose uploader then copies
each step to ``root``). :class:`Roots` keeps, for the manager:

- the roots' leases: one writer per root, taken at the first due save (``lease.py``);
- the steps committed on the root it commits on: one listing, kept current by the manager's own
  commits and deletions, each marker read before the step counts (``commit.py``);
- retention after each commit and each upload (``retention.py``);
- the branch a restore starts: committed steps after the restored one belong to the run it branched
  from; saving one replaces it, and retention neither counts nor deletes the others;
- taking a step that failed verification out of the checkpoints (``commit.quarantine``), under the
  root's lease;
- the error a failed background save or upload raises on the training thread.

Methods called by the committer or uploader thread (``clear_step_dir`` and ``after_commit``, the
writer's hooks; ``after_upload``) and by the training thread share :attr:`Roots.lock`.
"""

from __future__ import annotations

import errno
import logging
import threading
import warnings
from typing import Any

from checkpointd import commit
from checkpointd.errors import CheckpointWriteError, RootInUseError, StepAlreadyExistsError
from checkpointd.format import layout
from checkpointd.lease import RootLease
from checkpointd.policy import RetentionPolicy
from checkpointd.retention import MetricsCache, apply_retention
from checkpointd.save.inflight import InFlight
from checkpointd.save.job import SaveJob
from checkpointd.storage.store import Store
from checkpointd.tiers import Uploader

logger = logging.getLogger("checkpointd")

Damaged = tuple[Store, int, BaseException]
"""A copy of a step that failed verification: its store, the step, the error."""


def failure_hint(exc: BaseException) -> str:
    """What to do about a background failure, for the causes that have an obvious remedy."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        return " The storage is full: free space (or lower keep_last) and the next save will succeed."
    if isinstance(exc, PermissionError):
        return " Check that this process may write to the checkpoint root."
    return ""


class Roots:
    """The roots of one manager (see the module docstring).

    Args:
        store: the root saves commit on (``local_dir`` with two tiers).
        remote: with two tiers, the root steps are uploaded to; else None.
        dist: the manager's DistributedRuntime, or None; a distributed job is one writer: rank 0
            takes the leases, applies retention and moves damaged steps.
        retention: which committed steps to keep.
        inflight: the manager's saves in flight (retention never deletes one).
        lease_timeout_secs: see ``IOOptions.lease_timeout_secs``.
    """

    def __init__(self, store: Store, remote: Store | None, dist: Any, retention: RetentionPolicy, inflight: InFlight,
                 lease_timeout_secs: float) -> None:
        self.store = store
        self.remote = remote
        self.dist = dist
        self.retention = retention
        self.inflight = inflight
        self.lock = threading.RLock()
        self.leases: list[RootLease] = []
        if dist is None or dist.is_rank0:
            self.leases = [RootLease(s, timeout_secs=float(lease_timeout_secs)) for s in (store, remote) if s is not None]
        self.leases_taken = False
        self.metrics = MetricsCache(store)
        self.last_committed: int | None = None
        self.branched_from: int | None = None
        """The step the last restore returned: saves of committed steps after it replace them."""
        self.stale_steps: set[int] = set()
        """Committed steps after ``branched_from`` not yet replaced: retention neither counts nor deletes them."""
        self.uploader: Uploader | None = None
        self._marked: set[int] | None = None
        """Steps with a marker in the root's listing (a cache; each is checked before it counts)."""

    # -- leases ------------------------------------------------------------------------------------
    def take_leases(self) -> None:
        """One writer per root: at the first due save, before anything is written (every rank of a
        distributed job raises rank 0's refusal alike, instead of waiting in a collective).

        Raises:
            RootInUseError: another live writer holds the root (the message names it).
            CheckpointWriteError: the root cannot be written at all.
        """
        if self.leases_taken:
            return
        error: tuple[bool, str] | None = None
        try:
            for lease in self.leases:
                lease.acquire()
        except RootInUseError as exc:
            error = (True, str(exc))
        except OSError as exc:  # the root cannot be written at all (a file in the way, no permission)
            error = (False, f"cannot save under {lease.store.display()}: {type(exc).__name__}: {exc}; "
                            "nothing was written. Pass a writable directory as the root")
        if self.dist is not None:
            error = self.dist.agree(error)
        if error is not None:
            self.release_leases()
            raise (RootInUseError if error[0] else CheckpointWriteError)(error[1])
        self.leases_taken = True

    def release_leases(self) -> None:
        for lease in self.leases:
            lease.release()

    def start_uploader(self, file_threads: int) -> Uploader:
        """Two tiers: the uploader from the local root to the remote one, resuming uploads a crash left."""
        assert self.remote is not None
        self.uploader = Uploader(self.store, self.remote, self.retention, file_threads=file_threads,
                                 on_uploaded=self.after_upload)
        self.uploader.before_marker = self.leases[1].check
        self.uploader.resume_pending(before_first=self.take_leases)
        return self.uploader

    # -- committed steps ---------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Committed steps, ascending (marker present; no data read); with two tiers, on either tier."""
        if self.remote is not None:
            return sorted(set(commit.committed_steps(self.store)) | set(commit.committed_steps(self.remote)))
        return commit.committed_steps(self.store)

    def marked_steps(self) -> set[int]:
        """Steps with a marker, from one listing of the root, kept up to date by this manager's commits."""
        with self.lock:
            if self._marked is None:
                self._marked = set(commit.candidate_steps(self.store))
            return self._marked

    def is_committed(self, step: int) -> bool:
        """Whether ``step`` is committed: read only when the listing shows a marker for it."""
        with self.lock:
            return step in self.marked_steps() and commit.is_committed(self.store, layout.step_dir_name(step))

    def forget(self, step: int) -> None:
        """``step`` is no longer committed (removed, or moved away as damaged)."""
        with self.lock:
            if self._marked is not None:
                self._marked.discard(step)

    def branched(self, step: int | None) -> None:
        """After a restore of ``step``: later committed steps belong to the run it branched from."""
        self.branched_from = step
        self.stale_steps = (set() if step is None
                            else {s for s in self.marked_steps() if s > step and self.is_committed(s)})

    def check_replace(self, step: int) -> None:
        """``step`` is committed and the manager does not overwrite: only a branch may replace it.

        Raises:
            StepAlreadyExistsError: ``step`` is not after the step the run was restored from.
        """
        if self.branched_from is None or step <= self.branched_from:
            raise StepAlreadyExistsError(
                f"step {step} is already committed at {self.store.display(layout.step_dir_name(step))}; "
                "resume with `start = mgr.resume()` (the step after the newest checkpoint), or pass overwrite=True"
            )
        warnings.warn(f"checkpointd: step {step} replaces the committed step {step} of the run this one branched "
                      f"from: it was restored at step {self.branched_from}", RuntimeWarning, stacklevel=3)

    # -- the committer's side ----------------------------------------------------------------------
    def clear_step_dir(self, step_dir: str) -> None:
        """Remove an uncommitted leftover (or, with overwrite=True, the committed step) before writing."""
        if self.dist is not None and not self.dist.is_rank0:
            return  # rank 0 clears; the commit protocol keeps the others from writing before it did
        if self.store.exists(step_dir) or self.store.list_dir(step_dir):
            logger.info("checkpointd: removing the contents of %s before saving", self.store.display(step_dir))
            commit.uncommit_and_remove(self.store, step_dir)
            self.forget(layout.parse_step_dir_name(step_dir) or -1)

    def after_commit(self, job: SaveJob) -> None:
        """On the committer thread: record the commit, queue its upload (two tiers), then apply retention."""
        if self.uploader is not None:
            self.uploader.submit(job.step)
        with self.lock:
            if self._marked is not None:
                self._marked.add(job.step)
            self.metrics.record(job.step, job.manifest.metrics)
            self.last_committed = job.step if self.last_committed is None else max(self.last_committed, job.step)
            if self.dist is not None and not self.dist.is_rank0:
                self._marked = None  # rank 0 applied retention; list again on the next check
                return
        try:
            self.apply_retention(job.step)
        except Exception as exc:  # noqa: BLE001 - retention failing must not fail a committed save
            logger.warning("checkpointd: retention after step %d failed: %s", job.step, exc)

    def after_upload(self, step: int) -> None:
        """On the uploader thread (two tiers): local retention again, now that ``step`` is uploaded."""
        last = self.last_committed
        if last is not None:
            self.apply_retention(last)

    def apply_retention(self, just_committed: int) -> None:
        protected = self.inflight.steps() - {just_committed}
        if self.uploader is not None:
            protected |= self.uploader.pending_steps()  # never delete a step before its upload
        deleted = apply_retention(self.store, self.retention, just_committed, protected, self.metrics,
                                  ignored=frozenset(self.stale_steps))
        with self.lock:
            if self._marked is not None:
                self._marked.difference_update(deleted)

    def raise_failures(self) -> None:
        """Raise the first background failure not raised yet: an upload's, then a save's.

        Raises:
            CheckpointWriteError: naming the step, where it was going, and what to do about it.
        """
        upload_failure = self.uploader.pop_failure() if self.uploader is not None else None
        if upload_failure is not None:
            step, exc = upload_failure
            raise CheckpointWriteError(
                f"upload of step {step} to {self.remote.display(layout.step_dir_name(step))} failed: "  # type: ignore[union-attr]
                f"{type(exc).__name__}: {exc}. The step is committed locally at "
                f"{self.store.display(layout.step_dir_name(step))}, not remotely; earlier uploads are intact."
                f"{failure_hint(exc)}",
                step=step,
            ) from exc
        failure = self.inflight.pop_failure()
        if failure is None:
            return
        job, exc = failure
        raise CheckpointWriteError(
            f"background save of step {job.step} to {self.store.display(job.step_dir)} failed: "
            f"{type(exc).__name__}: {exc}. Nothing of step {job.step} was committed; earlier checkpoints are intact."
            f"{failure_hint(exc)}",
            step=job.step,
        ) from exc

    # -- damaged steps -----------------------------------------------------------------------------
    def quarantine_all(self, damaged: list[Damaged]) -> None:
        """Once a restore succeeded: take the newer steps that failed verification out of the checkpoints.

        Only then: a root where no step verifies keeps them, so every restart raises instead of
        starting from scratch.
        """
        for store, step, exc in damaged:
            moved = self.quarantine(store, step, exc)
            if moved:
                logger.warning("checkpointd: step %d did not verify; its files were moved to %s", step, moved)

    def quarantine(self, store: Store, step: int, exc: BaseException) -> str | None:
        """A step that failed verification stops being committed (rank 0 acts for a distributed job).

        Returns where its files went, or None when they stay (another rank's job, or a live writer
        holds the root).
        """
        self.forget(step)
        if self.dist is not None and not self.dist.is_rank0:
            return None
        lease = next((lease for lease in self.leases if lease.store is store), None)
        took = False
        if lease is not None and not lease.held:
            try:  # moving a step is a write: never under a live writer of this root
                lease.acquire()
                took = True
            except RootInUseError as busy:
                logger.warning("checkpointd: step %d failed verification; left in place: %s", step, busy)
                return None
        try:
            moved = commit.quarantine(store, layout.step_dir_name(step), f"{type(exc).__name__}: {exc}")
        finally:
            if took and not self.leases_taken:
                lease.release()  # type: ignore[union-attr]
        return None if moved is None else store.display(moved)


__all__ = ["Damaged", "Roots", "failure_hint"]
