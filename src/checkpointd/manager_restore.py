"""The restore side of :class:`checkpointd.CheckpointManager`: which step to restore, and from where.

``restore_latest`` walks the committed steps newest first and restores the first that verifies
(two tiers: ``tiers.restore_latest_two_tier`` picks between the local and the remote copy); the
newer steps that failed verification are then taken out of the checkpoints
(:meth:`checkpointd.manager_roots.Roots.quarantine_all`). ``restore_exact`` restores one named step.
Either loads through :func:`checkpointd.restore.step.restore_in_place` (verified parallel reads, then
in-place copies into the registered objects), or, under torch.distributed, through the runtime, where
every rank verifies, the ranks agree, and each loads its part.
"""

from __future__ import annotations

import warnings
from typing import Any

from checkpointd import commit
from checkpointd.errors import NOT_VERIFIED, CheckpointNotFoundError, CorruptCheckpointError
from checkpointd.format import layout
from checkpointd.manager_roots import Damaged, Roots
from checkpointd.policy import SaveSchedule
from checkpointd.restore import step as restore_mod
from checkpointd.rng import restore_rng
from checkpointd.state import Entry
from checkpointd.storage.store import Store
from checkpointd.tiers import restore_latest_two_tier


class Restorer:
    """Restores a manager's registered state from its roots.

    Args:
        roots: the manager's roots (listing, damaged steps).
        entries: the registered state.
        schedule: told that a step was restored (``every_n_seconds`` counts from there).
        dist: the manager's DistributedRuntime, or None.
    """

    def __init__(self, roots: Roots, entries: list[Entry], schedule: SaveSchedule, dist: Any) -> None:
        self.roots = roots
        self.entries = entries
        self.schedule = schedule
        self.dist = dist

    def restore_latest(self) -> int | None:
        """Restore the newest committed step that verifies; None when there is none.

        Raises:
            CorruptCheckpointError: committed steps exist but none verifies.
        """
        roots, dist = self.roots, self.dist
        if roots.remote is not None:
            return restore_latest_two_tier(roots.store, roots.remote, self.restore_step, roots.quarantine_all)
        # newest first, each checked only when reached: committed, and those whose manifest does not
        # match their marker (damage); a marker that is not valid (a save still writing it) is no step
        if dist is None:
            steps = commit.candidate_steps(roots.store)
        else:  # rank 0's listing, checked there, for every rank alike
            steps = dist.agree(commit.marked_steps(roots.store) if dist.is_rank0 else None)
        failures: list[str] = []
        damaged: list[Damaged] = []
        tried = 0
        for step in reversed(steps):
            if dist is None and not commit.has_valid_marker(roots.store, layout.step_dir_name(step)):
                continue
            tried += 1
            try:
                self.restore_step(step)
            except NOT_VERIFIED as exc:
                warnings.warn(f"checkpointd: skipping step {step}, it does not verify: {exc}", RuntimeWarning, stacklevel=3)
                failures.append(f"step {step}: {exc}")
                damaged.append((roots.store, step, exc))
                continue
            roots.quarantine_all(damaged)
            return step
        if not tried:
            return None
        raise CorruptCheckpointError(
            f"{roots.store.display()} holds {tried} committed step(s) but none verifies: " + "; ".join(failures[:5])
        )

    def restore_exact(self, step: int) -> None:
        """Restore ``step``; one that fails verification is taken out of the checkpoints unless it is
        the only committed step, and its error raised.

        Raises:
            CheckpointNotFoundError: ``step`` is not committed (on either tier).
        """
        roots = self.roots
        store = roots.store
        if roots.remote is not None and not commit.is_committed(store, layout.step_dir_name(step)):
            store = roots.remote  # two tiers: the local copy is gone (retention, another node): remote
        if not commit.is_committed(store, layout.step_dir_name(step)):
            raise CheckpointNotFoundError(
                f"step {step} is not committed under {store.display()} (committed: {roots.steps()[-10:]})"
            )
        try:
            self.restore_step(step, store)
        except NOT_VERIFIED as exc:
            if len(roots.steps()) > 1:  # never the last committed step: restarts must keep raising
                roots.quarantine(store, step, exc)
            raise

    def restore_step(self, step: int, store: Store | None = None) -> None:
        """Verify and load ``step`` of ``store`` (default: the root saves commit on) in place."""
        step_dir = layout.step_dir_name(step)
        store = self.roots.store if store is None else store
        if self.dist is not None:  # every rank verifies, they agree, each loads its part in place
            self.dist.restore_step(store, step_dir)
            self.schedule.mark_saved()
            return
        manifest, contents = restore_mod.restore_in_place(store, step_dir, self.entries)
        rng = restore_mod.rng_of(manifest, contents)
        if rng is not None and manifest.world_size == 1:  # per-rank RNG of a distributed run: see distributed/runtime.py
            restore_rng(rng)
        box = [contents, rng]
        del contents, rng
        restore_mod.drop_later(box)  # the read buffers are freed off this thread
        self.schedule.mark_saved()


__all__ = ["Restorer"]
