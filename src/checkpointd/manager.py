"""CheckpointManager: the public entry point. Orchestration only; each stage lives in its own module.

A save, in order (``maybe_save`` on the training thread, then the background writer):

1. ``policy.SaveSchedule``   is this step due?
2. ``state.build_files``     state dicts -> one tree per file of SPEC §3, validated (bad state raises here)
3. ``savejob.stage_save``    tensors -> ``snapshot.Snapshotter``: reused (pinned) CPU buffers; on CUDA the
                             copies go on a side stream; returns the background job
   --- ``maybe_save`` returns here; the rest runs on the committer thread (``writer.py``) ---
4. ``serialize.plan_pt``     pickle each tree (while the device-to-host copies still run, see
                             ``SaveJob.plan_files``); ``writer.write_one_file``: ``serialize``/``ptlayout``
                             -> ``compress`` -> checksum -> ``storage``
5. ``commit``                manifest.json, then COMMITTED, written last
6. ``retention``             ``policy.RetentionPolicy`` decides; committed steps it drops and uncommitted
                             leftovers are deleted (marker first)

Restore goes ``restore.restore_in_place``: ``commit.read_committed_manifest`` -> ``restore.read_step``
(``fastload``: parallel verified reads) -> ``restore.check_compatible`` -> ``restore_apply.apply_entries``
(in-place bulk copies, ``bulkcopy``). Construction helpers live in ``manager_setup.py``. Distributed runs (``distributed/``) and two tiers
(``tiers.py``) plug into the same path; ``preemption.py`` turns signals into a forced save.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import warnings
from typing import Any, Iterable, Mapping

import torch

from checkpointd import commit
from checkpointd.save import gcfreeze
from checkpointd.format import layout
from checkpointd.storage import ptlayout
from checkpointd.storage import recycle
from checkpointd.restore import step as restore_mod
from checkpointd.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    ConfigError,
    CorruptCheckpointError,
    NOT_VERIFIED,
    RootInUseError,
    StepAlreadyExistsError,
)
from checkpointd.policy import RetentionPolicy, SaveSchedule
from checkpointd.retention import MetricsCache, apply_retention
from checkpointd.rng import capture_rng, restore_rng
from checkpointd.save.savejob import blank_file_sizes, files_ahead, prewarm_reductions, stage_save, staging_layout
from checkpointd.save.snapshot import Snapshotter
from checkpointd.state import build_entries, build_files, clean_metrics
from checkpointd.storage.store import Store
from checkpointd.save.inflight import InFlight
from checkpointd.lease import RootLease
from checkpointd.manager_setup import (
    as_step,
    as_steps,
    check_host_budget,
    distributed_runtime,
    failure_hint,
    mdlus_members,
    open_store,
    physicsnemo_detector,
    register_flush_at_exit,
)
from checkpointd.save.writer import BackgroundWriter, SaveJob

logger = logging.getLogger("checkpointd")

_VALID_MODES = ("full", "sharded")

class CheckpointManager:
    """Asynchronous checkpoints of ``state`` under ``root`` (SPEC §1).

    The training thread calls :meth:`maybe_save` every step; it returns in milliseconds. Files are
    written by background threads and committed with a marker written last. See the README for the
    guarantees and for what ``wait_for_snapshot`` is for.

    Args:
        root: local path or fsspec URL.
        state: name -> nn.Module | Optimizer | LRScheduler | GradScaler | object with
            state_dict()/load_state_dict() | tensor | dict/list of plain data.
        every_n_steps / every_n_seconds / at_steps: when ``maybe_save`` saves.
        keep_last / keep_every_n_steps / keep_best / best_metric / best_mode: retention.
        compression: None or a codec name ("zstd").
        mode: "full" or "sharded" (matters only under torch.distributed).
        storage_options: passed to fsspec.
        max_pending: saves in flight before ``maybe_save`` waits for the oldest.
        overwrite: allow re-saving a committed step (the old one is deleted first).
        retry_timeout_secs: how long transient storage errors are retried before a save fails.
        file_threads: files written in parallel per save.
        device_staging_budget_bytes: opt-in device staging: when the CUDA tensors of a save fit in
            this many bytes of GPU memory, they are first cloned into a reused GPU buffer (~2 TB/s), so
            training never waits for the device-to-host copy. Costs that much GPU memory.
        host_staging_budget_bytes: opt-in host budget: stage CUDA state through a fixed ring of pinned
            chunks totalling at most this many bytes (allocated once, reused) instead of one pinned
            buffer the size of the state. The writer streams the state through it; the optimizer step
            (and the registered modules' forward, for their buffers) waits on the host until every
            tensor left the device, which costs about (state - budget) / write bandwidth per save.
            With device staging also on and fitting, the stream reads the GPU copy and nothing waits.
            Ignored (logged) on CPU-only torch; rejected with ``mode="full"`` under torch.distributed.
        local_dir: two tiers (see ``tiers.py``): commit every save on this local directory first,
            then upload it to ``root`` in the background; ``restore_latest`` prefers a verified local copy.
        save_on_signals: True (SIGTERM and SIGUSR1) or signal numbers: on such a signal the next
            ``maybe_save`` saves whatever the schedule says (see ``preemption.py``); main thread only.
        dist_timeout_secs: under torch.distributed, how long a rank waits for the others in the
            manager's own coordination (a dead rank fails the save after this, instead of hanging).
        freeze_gc: collect, then ``gc.freeze()`` the objects alive at construction until the last
            manager closes, so that the full collections a save's objects trigger stay short (see
            ``gcfreeze.py``: otherwise one costs the training thread 60-180 ms every few saves).
        lease_timeout_secs: one writer per root: the first save takes a lease on the root (and on
            ``local_dir``), renewed every quarter of this; a writer on another host whose lease was
            not renewed for this long is taken over (one on this host as soon as its process is gone).
            See ``lease.py``.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        state: Mapping[str, Any],
        *,
        every_n_steps: int | None = None,
        every_n_seconds: float | None = None,
        at_steps: Iterable[int] = (),
        keep_last: int | None = 3,
        keep_every_n_steps: int | None = None,
        keep_best: int = 0,
        best_metric: str | None = None,
        best_mode: str = "min",
        compression: str | None = "zstd",
        mode: str = "full",
        storage_options: dict[str, Any] | None = None,
        max_pending: int = 1,
        overwrite: bool = False,
        retry_timeout_secs: float = 120.0,
        file_threads: int | None = None,
        dist_timeout_secs: float = 600.0,
        device_staging_budget_bytes: int | None = None,
        host_staging_budget_bytes: int | None = None,
        local_dir: str | os.PathLike[str] | None = None,
        save_on_signals: bool | Iterable[int] = False,
        freeze_gc: bool = True,
        lease_timeout_secs: float = 60.0,
    ) -> None:
        if mode not in _VALID_MODES:
            raise ConfigError(f"mode must be one of {_VALID_MODES}, got {mode!r}")
        if not isinstance(max_pending, int) or max_pending < 1:
            raise ConfigError(f"max_pending must be an int >= 1, got {max_pending!r}")
        if not (isinstance(retry_timeout_secs, (int, float)) and retry_timeout_secs >= 0):
            raise ConfigError(f"retry_timeout_secs must be a number >= 0, got {retry_timeout_secs!r}")
        check_host_budget(host_staging_budget_bytes, mode)
        self._schedule = SaveSchedule(every_n_steps=every_n_steps, every_n_seconds=every_n_seconds,
                                      at_steps=frozenset(as_steps(at_steps)))
        self._retention = RetentionPolicy(keep_last=keep_last, keep_every_n_steps=keep_every_n_steps,
                                          keep_best=keep_best, best_metric=best_metric, best_mode=best_mode)
        from checkpointd.codecs.compress import get_codec

        self._codec = get_codec(compression)
        self._mode = mode
        self._overwrite = bool(overwrite)
        self._max_pending = max_pending
        self._store = open_store(root, storage_options, retry_timeout_secs)
        self._exit_timeout_secs = retry_timeout_secs + 60.0
        self._remote: Store | None = None
        if local_dir is not None:  # two tiers: saves commit on local disk, the uploader copies them to root
            self._remote = self._store
            self._store = open_store(local_dir, None, retry_timeout_secs)
        self._entries = build_entries(state, physicsnemo_detector())
        self._dist = distributed_runtime(self._entries, mode, dist_timeout_secs)
        if not (isinstance(lease_timeout_secs, (int, float)) and lease_timeout_secs > 0):
            raise ConfigError(f"lease_timeout_secs must be a number > 0, got {lease_timeout_secs!r}")
        self._leases: list[RootLease] = []
        """One writer per root, taken at the first due save; a distributed job is one writer: rank 0's."""
        self._leases_taken = False
        if self._dist is None or self._dist.is_rank0:
            self._leases = [RootLease(s, timeout_secs=float(lease_timeout_secs))
                            for s in (self._store, self._remote) if s is not None]
        self._closed = False
        self._lock = threading.RLock()
        self._inflight = InFlight()
        self._marked: set[int] | None = None
        """Steps with a marker in the root's listing (a cache; each is checked before it counts)."""
        self._metrics = MetricsCache(self._store)
        self._last_committed: int | None = None
        self._branched_from: int | None = None
        """The step the last restore returned: saves of committed steps after it replace them (a branch)."""
        self._stale_steps: set[int] = set()
        """Committed steps after ``_branched_from`` not yet replaced: retention neither counts nor deletes them."""
        if device_staging_budget_bytes is not None and (not isinstance(device_staging_budget_bytes, int) or device_staging_budget_bytes < 0):
            raise ConfigError(f"device_staging_budget_bytes must be an int >= 0 or None, got {device_staging_budget_bytes!r}")
        self._snap = Snapshotter(max_arenas=max_pending, device_budget_bytes=device_staging_budget_bytes,
                                 host_budget_bytes=host_staging_budget_bytes, on_arena_ready=prewarm_reductions)
        threads = file_threads or min(8, max(2, (os.cpu_count() or 2)))
        self._writer = (BackgroundWriter(self._store, self._codec, file_threads=threads) if self._dist is None
                        else self._dist.make_writer(self._store, self._codec, threads))
        if self._leases:
            self._writer.before_marker = self._leases[0].check  # no commit once another writer took the root
        self._hooks: list[Any] = []
        self._opt_state_sizes: dict[int, int] = {}
        self._uploader: Any = None
        if self._remote is not None:
            if self._dist is not None:
                raise ConfigError("local_dir (two tiers) is for single-process runs; under torch.distributed save to root")
            from checkpointd.tiers import Uploader

            self._uploader = Uploader(self._store, self._remote, self._retention, file_threads=threads,
                                      on_uploaded=self._after_upload)
            self._uploader.before_marker = self._leases[1].check
            self._uploader.resume_pending(before_first=self._take_leases)
        self._preemption: Any = None
        from checkpointd.preemption import PreemptionWatcher, resolve_signals

        signals = resolve_signals(save_on_signals)
        if signals:
            self._preemption = PreemptionWatcher(signals)
        self._install_hooks()
        self._atexit = register_flush_at_exit(self) if self._dist is None else None
        self._froze_gc = bool(freeze_gc)
        if self._froze_gc:
            gcfreeze.acquire()
        # Staging buffers are prepared at the first restore's end, maybe_save call or optimizer step,
        # not here: pinning gigabytes in the background makes a restore that runs meanwhile read files
        # several times slower (page faults and cudaHostRegister contend), and a restore comes first.
        self._buffers_pending = True
        self._files_ahead: Any = None
        """Blank files for the first saves (``recycle.FilesAhead``), made with the staging buffers; False: none."""

    # ------------------------------------------------------------------------------------------
    # saving
    # ------------------------------------------------------------------------------------------
    def maybe_save(self, step: int, *, metrics: Mapping[str, Any] | None = None, force: bool = False) -> bool:
        """Start a save of ``step`` if it is due (or ``force``); returns True if one was started.

        Called on the training thread. Blocks only to snapshot (CPU: copy; CUDA: queue copies) and,
        when ``max_pending`` saves are already in flight, to wait for the oldest.

        Raises:
            StateError: registered state that cannot be saved (nothing is written).
            StepAlreadyExistsError: ``step`` is committed and ``overwrite`` is False.
            CheckpointWriteError: an earlier background save failed.
        """
        self._check_open()
        self._prepare_pending_buffers()
        self._raise_failures()
        step = as_step(step)
        preempted = self._preemption is not None and self._preemption.save_pending
        due = force or preempted or self._schedule.is_due(step)
        if self._dist is not None and not force:  # rank 0 decides time-based saves for every rank
            due = self._dist.is_due(due, time_based=self._schedule.every_n_seconds is not None)
        if not due:
            return False
        if step in self._inflight.steps():
            return False
        self._take_leases()
        with self._lock:
            already = self._is_committed(step)
        if preempted and already and not force and not self._overwrite:
            self._preemption.save_pending = False  # this step is saved already: nothing more to do
            return False
        if already and not self._overwrite:
            if self._branched_from is None or step <= self._branched_from:
                raise StepAlreadyExistsError(
                    f"step {step} is already committed at {self._store.display(layout.step_dir_name(step))}; "
                    "resume with `start = mgr.resume()` (the step after the newest checkpoint), or pass overwrite=True"
                )
            warnings.warn(f"checkpointd: step {step} replaces the committed step {step} of the run this one branched "
                          f"from: it was restored at step {self._branched_from}", RuntimeWarning, stacklevel=2)
        self._stale_steps.discard(step)
        t0 = time.perf_counter()
        clean = clean_metrics(metrics)
        if self._dist is None:
            files = build_files(self._entries, step, clean, capture_rng(), self._codec.suffix,
                                mdlus_members=mdlus_members())
            locations, extra = None, {"rng_file": files[-1].rel_path}
        else:  # full mode gathers here, collectively, on every rank
            files, locations, extra = self._dist.build_files(step, clean, capture_rng(), self._codec.suffix,
                                                             mdlus_members())
        try:
            self._snap.flush()  # an earlier snapshot's copies must be queued before this save point
            # Backpressure: never hold the lock here, the committer thread needs it to finish the oldest save.
            while len(self._inflight) >= self._max_pending:
                self._inflight.wait_for(self._inflight.oldest(), timeout=None)  # type: ignore[arg-type]
            if self._uploader is not None:  # a slow remote bounds the local backlog, not an ever-growing queue
                self._uploader.wait_backlog(self._max_pending)
            self._raise_failures()
            job = stage_save(step=step, files=files, entries=self._entries, snapshotter=self._snap, metrics=clean,
                             mode=self._mode, world_size=1 if self._dist is None else self._dist.world_size,
                             codec_name=self._codec.name, locations=locations, extra=extra,
                             clear_step_dir=self._clear_step_dir)
        except BaseException as exc:
            if self._dist is not None:  # the ranks agreed to save `step`: fail it on every rank now, naming this error
                self._dist.abandon(step, exc)
            raise
        job.after_commit = self._after_commit
        job.fast = preempted or ptlayout.fast_persist()  # the grace period waits for a preemption save
        self._inflight.add(job, time.perf_counter() - t0)
        self._writer.submit(job)
        self._schedule.mark_saved()
        if preempted:
            self._preemption.save_pending = False
            logger.warning("checkpointd: %s received; saving step %d now", self._preemption.received.name, step)
        return True

    def save(self, step: int, *, metrics: Mapping[str, Any] | None = None) -> None:
        """``maybe_save(step, force=True)``."""
        self.maybe_save(step, metrics=metrics, force=True)

    def _take_leases(self) -> None:
        """One writer per root: at the first due save, before anything is written (every rank of a
        distributed job raises rank 0's refusal alike, instead of waiting in a collective).

        Raises:
            RootInUseError: another live writer holds the root (the message names it).
        """
        if self._leases_taken:
            return
        error: tuple[bool, str] | None = None
        try:
            for lease in self._leases:
                lease.acquire()
        except RootInUseError as exc:
            error = (True, str(exc))
        except OSError as exc:  # the root cannot be written at all (a file in the way, no permission)
            error = (False, f"cannot save under {lease.store.display()}: {type(exc).__name__}: {exc}; "
                            "nothing was written. Pass a writable directory as the root")
        if self._dist is not None:
            error = self._dist.agree(error)
        if error is not None:
            for lease in self._leases:
                lease.release()
            raise (RootInUseError if error[0] else CheckpointWriteError)(error[1])
        self._leases_taken = True

    def _clear_step_dir(self, step_dir: str) -> None:
        """Remove an uncommitted leftover (or, with overwrite=True, the old commit) before writing."""
        if self._dist is not None and not self._dist.is_rank0:
            return  # rank 0 clears; the commit protocol keeps the others from writing before it did
        if self._store.exists(step_dir) or self._store.list_dir(step_dir):
            logger.info("checkpointd: removing previous contents of %s before saving", self._store.display(step_dir))
            commit.uncommit_and_remove(self._store, step_dir)
            with self._lock:
                if self._marked is not None:
                    self._marked.discard(layout.parse_step_dir_name(step_dir) or -1)

    def _after_commit(self, job: SaveJob) -> None:
        """On the committer thread: record the commit, queue its upload (two tiers), then apply retention."""
        if self._uploader is not None:
            self._uploader.submit(job.step)
        with self._lock:
            if self._marked is not None:
                self._marked.add(job.step)
            self._metrics.record(job.step, job.manifest.metrics)
            self._last_committed = job.step if self._last_committed is None else max(self._last_committed, job.step)
            if self._dist is not None and not self._dist.is_rank0:
                self._marked = None  # rank 0 applied retention; re-list on the next check
                return
        try:
            self._apply_retention(job.step)
        except Exception as exc:  # noqa: BLE001 - retention failing must not fail a committed save
            logger.warning("checkpointd: retention after step %d failed: %s", job.step, exc)

    def _after_upload(self, step: int) -> None:
        """On the uploader thread (two tiers): local retention again, now that ``step`` is uploaded."""
        last = self._last_committed
        if last is not None:
            self._apply_retention(last)

    def _apply_retention(self, just_committed: int) -> None:
        protected = self._inflight.steps() - {just_committed}
        if self._uploader is not None:
            protected |= self._uploader.pending_steps()  # never delete a step before its upload
        deleted = apply_retention(self._store, self._retention, just_committed, protected, self._metrics,
                                  ignored=frozenset(self._stale_steps))
        with self._lock:
            if self._marked is not None:
                self._marked.difference_update(deleted)

    # ------------------------------------------------------------------------------------------
    # waiting and failures
    # ------------------------------------------------------------------------------------------
    def wait(self, timeout: float | None = None) -> None:
        """Block until every started save is committed (retention applied); re-raise a background failure.

        Raises:
            CheckpointTimeoutError: ``timeout`` seconds passed first (also a TimeoutError).
            CheckpointWriteError: a background save failed.
        """
        self._snap.flush()  # queue snapshot copies now rather than after the writer's grace period
        deadline = None if timeout is None else time.monotonic() + timeout
        while (job := self._inflight.oldest()) is not None:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._inflight.wait_for(job, remaining)
        if self._uploader is not None:
            self._raise_failures()  # a local failure first: its step will never be uploaded
            self._uploader.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        self._raise_failures()

    @property
    def preempted(self) -> bool:
        """True once a signal of ``save_on_signals`` arrived: save (the next ``maybe_save`` does), close, exit."""
        return self._preemption is not None and self._preemption.received is not None

    def wait_for_snapshot(self) -> None:
        """Block until the in-flight snapshot copies are in host memory.

        Needed only on CUDA, before code other than the registered optimizers' ``step()`` and the
        registered modules' forward writes registered tensors in place.
        """
        self._snap.wait_host()

    def _raise_failures(self) -> None:
        upload_failure = self._uploader.pop_failure() if self._uploader is not None else None
        if upload_failure is not None:
            step, exc = upload_failure
            raise CheckpointWriteError(
                f"upload of step {step} to {self._remote.display(layout.step_dir_name(step))} failed: "  # type: ignore[union-attr]
                f"{type(exc).__name__}: {exc}. The step is committed locally at "
                f"{self._store.display(layout.step_dir_name(step))}, not remotely; earlier uploads are intact."
                f"{failure_hint(exc)}",
                step=step,
            ) from exc
        failure = self._inflight.pop_failure()
        if failure is None:
            return
        job, exc = failure
        raise CheckpointWriteError(
            f"background save of step {job.step} to {self._store.display(job.step_dir)} failed: "
            f"{type(exc).__name__}: {exc}. Nothing of step {job.step} was committed; earlier checkpoints are intact."
            f"{failure_hint(exc)}",
            step=job.step,
        ) from exc

    # ------------------------------------------------------------------------------------------
    # restoring and listing
    # ------------------------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Committed steps, ascending (marker present; no data read); with two tiers, on either tier."""
        if self._remote is not None:
            return sorted(set(commit.committed_steps(self._store)) | set(commit.committed_steps(self._remote)))
        return commit.committed_steps(self._store)

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def resume(self, first_step: int = 0) -> int:
        """Restore the newest verified checkpoint and return the step to run next.

        The loop's one line for a job that may be a restart: ``start = mgr.resume()`` then
        ``for step in range(start, total): ...; mgr.maybe_save(step)``. Returns ``s + 1`` after
        restoring step ``s`` (the loop saved ``s`` after running it), ``first_step`` when the root holds
        no checkpoint. Raises like :meth:`restore_latest` when checkpoints exist but none verifies.
        """
        step = self.restore_latest()
        return first_step if step is None else step + 1

    def restore_latest(self) -> int | None:
        """Restore the newest committed step that verifies, in place; None if the root has none.

        A newer step that fails verification is skipped with a warning and, once an older one restored,
        taken out of the checkpoints (its marker removed, its files moved to
        ``<root>/.checkpointd-damaged/``), so the resumed run saves that step again. If committed steps exist but none verifies, raises
        CorruptCheckpointError (never silently restarts from scratch).
        """
        self._check_open()
        self.wait()
        try:
            step = self._restore_latest()
        finally:
            self._prepare_pending_buffers()
        self._branched(step)
        return step

    def _restore_latest(self) -> int | None:
        if self._remote is not None:
            from checkpointd.tiers import restore_latest_two_tier

            return restore_latest_two_tier(self._store, self._remote, self._restore_step, self._quarantine_all)
        # newest first, each checked only when reached: committed, and those whose manifest no longer
        # matches their marker (damage); a marker that is not valid (a save still writing it) is no step
        if self._dist is None:
            steps = commit.candidate_steps(self._store)
        else:  # rank 0's listing, checked there, for every rank alike
            steps = self._dist.agree(commit.marked_steps(self._store) if self._dist.is_rank0 else None)
        failures: list[str] = []
        damaged: list[tuple[Store, int, BaseException]] = []
        tried = 0
        for step in reversed(steps):
            if self._dist is None and not commit.has_valid_marker(self._store, layout.step_dir_name(step)):
                continue
            tried += 1
            try:
                self._restore_step(step)
            except NOT_VERIFIED as exc:
                warnings.warn(f"checkpointd: skipping step {step}, it does not verify: {exc}", RuntimeWarning, stacklevel=3)
                failures.append(f"step {step}: {exc}")
                damaged.append((self._store, step, exc))
                continue
            self._quarantine_all(damaged)
            return step
        if not tried:
            return None
        raise CorruptCheckpointError(
            f"{self._store.display()} holds {tried} committed step(s) but none verifies: " + "; ".join(failures[:5])
        )

    def _quarantine_all(self, damaged: list[tuple[Store, int, BaseException]]) -> None:
        """Once a restore succeeded: take the newer steps that failed verification out of the checkpoints.

        Only then: a root where no step verifies keeps them, so every restart raises instead of
        starting from scratch.
        """
        for store, step, exc in damaged:
            moved = self._quarantine(store, step, exc)
            if moved:
                logger.warning("checkpointd: step %d did not verify; its files were moved to %s", step, moved)

    def _quarantine(self, store: Store, step: int, exc: BaseException) -> str | None:
        """A step that failed verification stops being committed (rank 0 acts for a distributed job)."""
        with self._lock:
            if self._marked is not None:
                self._marked.discard(step)
        if self._dist is not None and not self._dist.is_rank0:
            return None
        lease = next((lease for lease in self._leases if lease.store is store), None)
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
            if took and not self._leases_taken:
                lease.release()  # type: ignore[union-attr]
        return None if moved is None else store.display(moved)

    def _branched(self, step: int | None) -> None:
        """After a restore of ``step``: later committed steps belong to the run it branched from."""
        self._branched_from = step
        self._stale_steps = set() if step is None else {s for s in self._marked_steps() if s > step and self._is_committed(s)}

    def restore(self, step: int) -> None:
        """Restore exactly ``step`` in place (verified first).

        A step that fails verification is taken out of the checkpoints (as in :meth:`restore_latest`,
        unless it is the only committed step) and the error raised. After a restore of ``step``, saving a committed step newer than it
        replaces that step, with a warning: the run has branched from ``step``.
        """
        self._check_open()
        self.wait()
        step = as_step(step)
        try:
            self._restore_exact(step)
        finally:
            self._prepare_pending_buffers()
        self._branched(step)

    def _restore_exact(self, step: int) -> None:
        store = self._store
        if self._remote is not None and not commit.is_committed(store, layout.step_dir_name(step)):
            store = self._remote  # two tiers: the local copy is gone (retention, another node): remote
        if not commit.is_committed(store, layout.step_dir_name(step)):
            raise CheckpointNotFoundError(
                f"step {step} is not committed under {store.display()} (committed: {self.steps()[-10:]})"
            )
        try:
            self._restore_step(step, store)
        except NOT_VERIFIED as exc:
            if len(self.steps()) > 1:  # never the last committed step: restarts must keep raising
                self._quarantine(store, step, exc)
            raise

    def _restore_step(self, step: int, store: Store | None = None) -> None:
        step_dir = layout.step_dir_name(step)
        store = self._store if store is None else store
        if self._dist is not None:  # every rank verifies, they agree, each loads its part in place
            self._dist.restore_step(store, step_dir)
            self._schedule.mark_saved()
            return
        manifest, contents = restore_mod.restore_in_place(store, step_dir, self._entries)
        rng = restore_mod.rng_of(manifest, contents)
        if rng is not None and manifest.world_size == 1:  # per-rank RNG of a distributed run: see distributed/runtime.py
            restore_rng(rng)
        box = [contents, rng]
        del contents, rng
        restore_mod.drop_later(box)  # the read buffers are freed off this thread
        self._schedule.mark_saved()

    # ------------------------------------------------------------------------------------------
    # stats, lifecycle
    # ------------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Per-phase seconds of the last committed save, totals, bytes and compression ratio.

        ``last_save`` also counts the save's ``files`` and how many of them were written over files
        from the recycling bin (``files_recycled``: retired or made ahead; only files of 16 MiB or
        more are recycled), which is what decides how fast a save writes to tmpfs."""
        out = self._inflight.stats()
        out.update({
            "last_committed_step": self._last_committed,
            "codec": self._codec.name,
            "pinned_bytes": self._snap.pinned_bytes,
            "staging_allocations": self._snap.arena_allocations,
            "staging_hook_wait_secs": self._snap.hook_wait_secs,
            "staging_arena_wait_secs": self._snap.arena_wait_secs,
            "staging_prepare_secs": self._snap.last_prepare_secs,
        })
        return out

    def close(self, timeout: float | None = None) -> None:
        """Wait for every started save, then release threads, hooks and buffers. Idempotent."""
        if self._closed:
            return
        try:
            self.wait(timeout)
        finally:
            if not len(self._inflight):
                self._shutdown()

    def _shutdown(self) -> None:
        self._closed = True
        if self._atexit is not None:
            atexit.unregister(self._atexit)
        if self._preemption is not None:
            self._preemption.uninstall()
        if self._uploader is not None:
            self._uploader.close()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._writer.close()
        for lease in self._leases:
            lease.release()
        self._snap.close()
        if getattr(self, "_files_ahead", None):
            self._files_ahead.stop()
        if self._store.is_local:
            try:
                recycle.empty(self._store)  # retired files kept for the next save: there is none
            except OSError as exc:
                logger.warning("checkpointd: cannot empty the recycling bin under %s: %s", self._store.display(), exc)
        if self._dist is not None:
            self._dist.close()
        if self._froze_gc:
            self._froze_gc = False
            gcfreeze.release()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        if exc_type is None:
            self.close()
        else:  # don't mask the user's exception with a checkpoint error
            try:
                self.close()
            except CheckpointError as exc:
                logger.error("checkpointd: error while closing after another exception: %s", exc)

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this CheckpointManager is closed; create a new one")

    def _marked_steps(self) -> set[int]:
        """Steps with a marker, from one listing of the root, kept up to date by this manager's commits."""
        if self._marked is None:
            self._marked = set(commit.candidate_steps(self._store))
        return self._marked

    def _is_committed(self, step: int) -> bool:
        """Whether ``step`` is committed: read only when the listing shows a marker for it."""
        return step in self._marked_steps() and commit.is_committed(self._store, layout.step_dir_name(step))

    # ------------------------------------------------------------------------------------------
    # hooks and buffer preparation
    # ------------------------------------------------------------------------------------------
    def _install_hooks(self) -> None:
        cuda = torch.cuda.is_available() or self._snap.needs_hooks
        for e in self._entries:
            if e.kind == "optimizer":
                if cuda:
                    self._hooks.append(e.obj.register_step_pre_hook(lambda *_: self._snap.wait_for_all()))
                    self._snap.has_step_hooks = True
                self._hooks.append(e.obj.register_step_post_hook(self._on_optimizer_step))
            elif e.kind == "module" and cuda:
                self._hooks.append(e.obj.register_forward_pre_hook(lambda *_: self._snap.wait_for_buffers()))

    def _on_optimizer_step(self, optimizer: Any, *_: Any) -> None:
        """After a step that created optimizer state (the first), prepare staging buffers for it."""
        size = len(optimizer.state)
        if self._opt_state_sizes.get(id(optimizer)) != size:
            self._opt_state_sizes[id(optimizer)] = size
            self._prepare_buffers()

    def _prepare_pending_buffers(self) -> None:
        """The deferred construction-time :meth:`_prepare_buffers` (see ``__init__``), once."""
        if self._buffers_pending:
            self._buffers_pending = False
            self._prepare_buffers()

    def _files_ahead_wait(self) -> bool:
        """Blank files made ahead wait while staging buffers are page-locked or a save writes: either
        competes with their making for the same memory (``recycle.FilesAhead``)."""
        return self._snap.preparing() or self._inflight.writing()

    def _saves_started(self) -> int:
        """Saves begun so far: blank files made ahead for saves that began without them are not made."""
        return self._inflight.counters.saves_started

    def _prepare_buffers(self) -> None:
        """Allocate (and pin) staging buffers for the current state layout, in the background."""
        self._buffers_pending = False
        if self._closed:
            return
        dist_rt = getattr(self, "_dist", None)
        try:
            if dist_rt is None:
                files = build_files(self._entries, 0, {}, capture_rng(), self._codec.suffix)
            else:  # sharded mode builds its files locally; full mode gathers (collective): its first save allocates
                files = dist_rt.staging_files(capture_rng(), self._codec.suffix)
                if files is None:
                    return
        except CheckpointError:
            return  # bad state is reported by maybe_save, where the user expects it
        self._snap.prepare_async(*staging_layout(self._entries, files))
        if getattr(self, "_files_ahead", None) is None:
            self._files_ahead = files_ahead(self._store, self._codec, files, busy=self._files_ahead_wait,
                                            saves_started=self._saves_started) or False
        elif self._files_ahead and self._saves_started() == 0:
            self._files_ahead.want(blank_file_sizes(files))  # e.g. the optimizer's state appeared since


__all__ = ["CheckpointManager"]
