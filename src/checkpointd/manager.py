"""CheckpointManager: the public entry point the training loop calls. Orchestration only.

A save, in order (``maybe_save`` on the training thread, then the background writer):

1. ``policy.SaveSchedule``           is this step due?
2. ``state.build_files``             state dicts -> one tree per file of SPEC §3, validated (bad state
                                     raises here)
3. ``save/savejob.py`` ``stage_save``  tensors -> ``save/snapshot.py`` ``Snapshotter``: reused (pinned) CPU
                                     buffers; on CUDA the copies go on a side stream; returns the job
   --- ``maybe_save`` returns here; the rest runs on the committer thread (``save/writer.py``
       ``BackgroundWriter._process``), on the job as data ---
4. ``save/planning.py``              ``plan_files`` (pickle each tree ahead, ``format/serialize.py``),
                                     ``wait_for_copies``, ``plan_files``/``plan_stream`` (the rest)
5. ``save/writer.py``                compress (``codecs/``), checksum and write each file through
                                     ``storage/store.py``; ``planning.release_staging``
6. ``commit.py``                     manifest.json, then COMMITTED, written last
7. ``retention.py``                  the writer's ``on_commit`` hook (``manager_roots.Roots.after_commit``):
                                     ``policy.RetentionPolicy`` decides; committed steps it drops and
                                     uncommitted leftovers are deleted (marker first)

A restore (``manager_restore.py``) reads the committed manifest (``commit.py``), then
``restore/step.py`` ``restore_in_place``: parallel verified reads, a compatibility check against the
registered state, and in-place copies into it.

The rest of the manager: ``manager_setup.py`` (argument checks, opening the roots, the distributed
runtime), ``manager_roots.py`` (leases, the committed-step listing, retention after each commit,
damaged steps, background failures), ``options.py`` (the tuning option groups). Distributed runs
(``distributed/``) and two tiers (``tiers.py``) plug into the same path; ``preemption.py`` turns
signals into a forced save.
"""

from __future__ import annotations

import atexit
import logging
import os
import time
from typing import Any, Iterable, Mapping

import torch

from checkpointd.storage import recyclebin
from checkpointd.errors import CheckpointError, ConfigError
from checkpointd.format.mdlus import is_physicsnemo_module, mdlus_json_members
from checkpointd.manager_restore import Restorer
from checkpointd.manager_roots import Roots
from checkpointd.manager_setup import (as_step, as_steps, check_arguments, choose_codec, distributed_runtime,
                                       open_store, register_flush_at_exit)
from checkpointd.options import DistributedOptions, IOOptions, StagingOptions
from checkpointd.policy import RetentionPolicy, SaveSchedule
from checkpointd.preemption import PreemptionWatcher, resolve_signals
from checkpointd.restore import bounce
from checkpointd.rng import capture_rng
from checkpointd.save import device_encode, gcfreeze
from checkpointd.save.inflight import InFlight
from checkpointd.save.savejob import blank_file_sizes, files_ahead, prewarm_reductions, stage_save, staging_layout
from checkpointd.save.snapshot import Snapshotter
from checkpointd.save.writer import BackgroundWriter
from checkpointd.state import build_entries, build_files, clean_metrics
from checkpointd.storage import writemode

logger = logging.getLogger("checkpointd")


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
        compression: ``"auto"`` (native files on local roots, ``"zstd-planes"`` on remote ones: see
            :func:`checkpointd.manager_setup.choose_codec`), None, or a codec name
            (``"zstd"``, ``"zstd-planes"``).
        mode: "full" or "sharded" (matters only under torch.distributed).
        storage_options: passed to fsspec.
        max_pending: saves in flight before ``maybe_save`` waits for the oldest.
        overwrite: allow re-saving a committed step (the committed one is deleted first).
        local_dir: two tiers (see ``tiers.py``): commit every save on this local directory first,
            then upload it to ``root`` in the background; ``restore_latest`` prefers a verified local copy.
        save_on_signals: True (SIGTERM and SIGUSR1) or signal numbers: on such a signal the next
            ``maybe_save`` saves whatever the schedule says (see ``preemption.py``); main thread only.
        staging: :class:`checkpointd.StagingOptions`: device and host staging budgets, gc freezing.
        io: :class:`checkpointd.IOOptions`: file threads, the storage retry budget, the root lease's timeout.
        distributed: :class:`checkpointd.DistributedOptions`: the ranks' coordination timeout.
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
        compression: str | None = "auto",
        mode: str = "full",
        storage_options: dict[str, Any] | None = None,
        max_pending: int = 1,
        overwrite: bool = False,
        local_dir: str | os.PathLike[str] | None = None,
        save_on_signals: bool | Iterable[int] = False,
        staging: StagingOptions = StagingOptions(),
        io: IOOptions = IOOptions(),
        distributed: DistributedOptions = DistributedOptions(),
    ) -> None:
        check_arguments(mode, max_pending, staging, io, distributed)
        self._schedule = SaveSchedule(every_n_steps=every_n_steps, every_n_seconds=every_n_seconds,
                                      at_steps=frozenset(as_steps(at_steps)))
        self._retention = RetentionPolicy(keep_last=keep_last, keep_every_n_steps=keep_every_n_steps,
                                          keep_best=keep_best, best_metric=best_metric, best_mode=best_mode)
        self._mode = mode
        self._overwrite = bool(overwrite)
        self._max_pending = max_pending
        self._store = open_store(root, storage_options, io.retry_timeout_secs)
        remote = None
        if local_dir is not None:  # two tiers: saves commit on local disk, the uploader copies them to root
            remote, self._store = self._store, open_store(local_dir, None, io.retry_timeout_secs)
        self._codec = choose_codec(compression, self._store)
        self._exit_timeout_secs = io.retry_timeout_secs + 60.0
        self._entries = build_entries(state, is_physicsnemo_module)
        self._dist = distributed_runtime(self._entries, mode, distributed.timeout_secs)
        if remote is not None and self._dist is not None:
            raise ConfigError("local_dir (two tiers) is for single-process runs; under torch.distributed save to root")
        self._closed = False
        self._inflight = InFlight()
        self._roots = Roots(self._store, remote, self._dist, self._retention, self._inflight, io.lease_timeout_secs)
        self._restorer = Restorer(self._roots, self._entries, self._schedule, self._dist)
        self._snap = Snapshotter(max_arenas=max_pending, device_budget_bytes=staging.device_budget_bytes,
                                 host_budget_bytes=staging.host_budget_bytes, on_arena_ready=prewarm_reductions)
        self._snap.device_encodes = device_encode.encodes_for(self._codec, self._store, staging, self._dist is None)
        threads = io.threads()
        # The writer's hooks: the committer thread's per-save work that belongs to the manager. A restore's
        # pinned bounce chunks are given back after each committed save (``bounce.release_pinned``).
        writer_hooks = {"clear_step_dir": self._roots.clear_step_dir, "on_commit": self._roots.after_commit,
                        "after_save": bounce.release_pinned}
        self._writer = (BackgroundWriter(self._store, self._codec, file_threads=threads, **writer_hooks)
                        if self._dist is None else self._dist.make_writer(self._store, self._codec, threads, **writer_hooks))
        if self._roots.leases:
            self._writer.before_marker = self._roots.leases[0].check  # no commit once another writer took the root
        self._hooks: list[Any] = []
        self._opt_state_sizes: dict[int, int] = {}
        self._uploader = self._roots.start_uploader(threads) if remote is not None else None
        signals = resolve_signals(save_on_signals)
        self._preemption = PreemptionWatcher(signals) if signals else None
        self._install_hooks()
        self._atexit = register_flush_at_exit(self._flush_at_exit) if self._dist is None else None
        self._froze_gc = staging.freeze_gc
        if self._froze_gc:
            gcfreeze.acquire()
        # Staging buffers are prepared at the first restore's end, maybe_save call or optimizer step,
        # not here: pinning gigabytes in the background makes a restore that runs meanwhile read files
        # several times slower (page faults and cudaHostRegister contend), and a restore comes first.
        self._buffers_pending = True
        self._files_ahead: Any = None
        """Blank files for the first saves (``filesahead.FilesAhead``), made with the staging buffers; False: none."""

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
        self._roots.raise_failures()
        step = as_step(step)
        preempted = self._preemption is not None and self._preemption.save_pending
        due = force or preempted or self._schedule.is_due(step)
        if self._dist is not None and not force:  # rank 0 decides time-based saves for every rank
            due = self._dist.is_due(due, time_based=self._schedule.every_n_seconds is not None)
        if not due:
            return False
        if step in self._inflight.steps():
            return False
        self._roots.take_leases()
        already = self._roots.is_committed(step)
        if preempted and already and not force and not self._overwrite:
            self._preemption.save_pending = False  # this step is saved already: nothing more to do
            return False
        if already and not self._overwrite:
            self._roots.check_replace(step)
        self._roots.stale_steps.discard(step)
        t0 = time.perf_counter()
        clean = clean_metrics(metrics)
        if self._dist is None:
            files = build_files(self._entries, step, clean, capture_rng(), self._codec.suffix,
                                mdlus_members=mdlus_json_members)
            locations, extra = None, {"rng_file": files[-1].rel_path}
        else:  # full mode gathers here, collectively, on every rank
            files, locations, extra = self._dist.build_files(step, clean, capture_rng(), self._codec.suffix,
                                                             mdlus_json_members)
        try:
            self._snap.flush()  # an earlier snapshot's copies must be queued before this save point
            # Backpressure: never hold Roots.lock here, the committer thread needs it to finish the oldest save.
            while len(self._inflight) >= self._max_pending:
                self._inflight.wait_for(self._inflight.oldest(), timeout=None)  # type: ignore[arg-type]
            if self._uploader is not None:  # a slow remote bounds the local backlog, not an ever-growing queue
                self._uploader.wait_backlog(self._max_pending)
            self._roots.raise_failures()
            job = stage_save(step=step, files=files, entries=self._entries, snapshotter=self._snap, metrics=clean,
                             # one process writes full-mode files whatever `mode` says (it matters only under torch.distributed)
                             mode="full" if self._dist is None else self._mode,
                             world_size=1 if self._dist is None else self._dist.world_size,
                             codec_name=self._codec.name, locations=locations, extra=extra,
                             fast=preempted or writemode.fast_persist())  # the grace period waits for a preemption save
        except BaseException as exc:
            if self._dist is not None:  # the ranks agreed to save `step`: fail it on every rank now, naming this error
                self._dist.abandon(step, exc)
            raise
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

    # ------------------------------------------------------------------------------------------
    # waiting
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
            self._roots.raise_failures()  # a local failure first: its step will never be uploaded
            self._uploader.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        self._roots.raise_failures()

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

    # ------------------------------------------------------------------------------------------
    # restoring and listing (manager_restore.py)
    # ------------------------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Committed steps, ascending (marker present; no data read); with two tiers, on either tier."""
        return self._roots.steps()

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

    def restore_latest(self, *, entries: Iterable[str] | None = None, strict: bool = True) -> int | None:
        """Restore the newest committed step that verifies, in place; None if the root has none.

        A newer step that fails verification is skipped with a warning and, once an older one restored,
        taken out of the checkpoints (its marker removed, its files moved to
        ``<root>/.checkpointd-damaged/``), so the resumed run saves that step again. If committed steps
        exist but none verifies, raises CorruptCheckpointError (never silently restarts from scratch).
        ``entries`` and ``strict``: as in :meth:`restore` (a partial restore verifies the files it reads).
        """
        selection = self._restorer.select(entries, strict)
        self._check_open()
        self.wait()
        try:
            step = self._restorer.restore_latest(selection)
        finally:
            self._prepare_pending_buffers()
        self._roots.branched(step)
        return step

    def restore(self, step: int, *, entries: Iterable[str] | None = None, strict: bool = True) -> None:
        """Restore exactly ``step`` in place (verified first).

        ``entries``: only these state names (ConfigError for one not registered); the others, and RNG
        state unless every entry is named, stay as they are; only their files are read. ``strict=False``:
        entries the step lacks, and inside a module missing, unexpected or reshaped keys, are left as
        they are (like ``load_state_dict(strict=False)``), named in one RuntimeWarning; optimizers,
        tensors and data must still fit (StateMismatchError). A step that fails verification is taken
        out of the checkpoints (as in :meth:`restore_latest`, unless it is the only committed step) and
        the error raised. After a restore of ``step``, saving a committed step newer than it replaces
        that step, with a warning: the run has branched from ``step``.
        """
        selection = self._restorer.select(entries, strict)
        self._check_open()
        self.wait()
        step = as_step(step)
        try:
            self._restorer.restore_exact(step, selection)
        finally:
            self._prepare_pending_buffers()
        self._roots.branched(step)

    def restore_from(self, path: str | os.PathLike[str], *, entries: Iterable[str] | None = None, strict: bool = True,
                     storage_options: dict[str, Any] | None = None, step: int | None = None) -> None:
        """Restore the registered objects in place from a checkpoint outside this manager's root.

        ``path``: anything :func:`checkpointd.load` reads (another root, its newest step or ``step``; a
        step directory; a PhysicsNeMo or DCP directory), verified; registered names it lacks are also
        looked up under their PhysicsNeMo names. ``entries``/``strict`` as in :meth:`restore`; RNG state
        is never restored. Under torch.distributed every rank loads the full values and copies its part
        (DTensor/FSDP2 local blocks included). The root, its steps and the schedule are untouched: the
        loop numbers the next saves (fine-tuning: from 0, in a new root).
        """
        selection = self._restorer.select(entries, strict)
        self._check_open()
        self.wait()
        try:
            self._restorer.restore_from(path, selection, storage_options, step)
        finally:
            self._prepare_pending_buffers()

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
            "last_committed_step": self._roots.last_committed,
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

    def _flush_at_exit(self) -> None:
        """At interpreter exit (single process): finish the saves of a manager that was never closed."""
        if self._closed or not len(self._inflight):
            return
        logger.warning("checkpointd: the manager was not closed; finishing %d save(s) before exit", len(self._inflight))
        try:
            self.close(timeout=self._exit_timeout_secs)
        except CheckpointError as exc:
            logger.error("checkpointd: a save could not be finished at exit: %s", exc)

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
        self._roots.release_leases()
        self._snap.close()
        if getattr(self, "_files_ahead", None):
            self._files_ahead.stop()
        if self._store.is_local:
            try:
                recyclebin.empty(self._store)  # retired files kept for the next save: there is none
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
        competes with their making for the same memory (``filesahead.FilesAhead``)."""
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
