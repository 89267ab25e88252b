"""The restore side of :class:`checkpointd.CheckpointManager`: which step to restore, from where, and which entries.

``restore_latest`` walks the committed steps newest first and restores the first that verifies
(two tiers: ``tiers.restore_latest_two_tier`` picks between the local and the remote copy); the
newer steps that failed verification are then taken out of the checkpoints
(:meth:`checkpointd.manager_roots.Roots.quarantine_all`). ``restore_exact`` restores one named step.
Either loads through :func:`checkpointd.restore.step.restore_in_place` (verified parallel reads, then
in-place copies into the registered objects), or, under torch.distributed, through the runtime, where
every rank verifies, the ranks agree, and each loads its part. ``restore_from`` loads a checkpoint
outside the roots through :func:`checkpointd.load` and applies its values the same way.

Partial and non-strict restores (``entries=``, ``strict=``; a :class:`~checkpointd.restore.per_entry.Selection`):

- ``entries``: only these registered entries are restored, the others stay as they are; only the files
  holding them are read (each verified as always; a sharded step is read whole). Damage in a file
  that is not read goes unnoticed by that restore, and its step is not taken out of the checkpoints.
- ``strict=False``: what does not fit is left as it is (see :mod:`checkpointd.restore.per_entry`),
  named in one RuntimeWarning per restore (rank 0's, under torch.distributed).
- RNG state is restored only when every registered entry is chosen (``entries`` None or naming all),
  ``strict`` or not: a model-only restore (fine-tuning) keeps the run's own RNG. ``restore_from``
  never restores RNG.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Iterable

from checkpointd import commit
from checkpointd.distributed.state_dicts import clean_fqn
from checkpointd.errors import NOT_VERIFIED, CheckpointNotFoundError, CorruptCheckpointError, StateMismatchError
from checkpointd.format import layout
from checkpointd.load import load
from checkpointd.manager_roots import Damaged, Roots
from checkpointd.policy import SaveSchedule
from checkpointd.restore import step as restore_mod
from checkpointd.restore.per_entry import Selection, select_entries
from checkpointd.rng import restore_rng
from checkpointd.state import Entry, unwrap_module
from checkpointd.storage.store import Store
from checkpointd.tiers import restore_latest_two_tier


class Restorer:
    """Restores a manager's registered state from its roots, or from another checkpoint.

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

    def select(self, names: Iterable[str] | None = None, strict: bool = True) -> Selection:
        """The registered entries a restore loads (ConfigError for a name that is not registered)."""
        return select_entries(self.entries, names, strict)

    def restore_latest(self, selection: Selection | None = None) -> int | None:
        """Restore the newest committed step that verifies; None when there is none.

        Raises:
            CorruptCheckpointError: committed steps exist but none verifies.
        """
        roots, dist = self.roots, self.dist
        sel = selection or self.select()
        if roots.remote is not None:
            return restore_latest_two_tier(roots.store, roots.remote, lambda s, store: self.restore_step(s, store, sel),
                                           roots.quarantine_all)
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
                self.restore_step(step, None, sel)
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

    def restore_exact(self, step: int, selection: Selection | None = None) -> None:
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
            self.restore_step(step, store, selection)
        except NOT_VERIFIED as exc:
            if len(roots.steps()) > 1:  # never the last committed step: restarts must keep raising
                roots.quarantine(store, step, exc)
            raise

    def restore_step(self, step: int, store: Store | None = None, selection: Selection | None = None) -> None:
        """Verify and load ``step`` of ``store`` (default: the root saves commit on) in place."""
        step_dir = layout.step_dir_name(step)
        store = self.roots.store if store is None else store
        sel = selection or self.select()
        if self.dist is not None:  # every rank verifies, they agree, each loads its part in place
            self.dist.restore_step(store, step_dir, sel)
            self.schedule.mark_saved()
            return
        manifest, contents, left = restore_mod.restore_in_place(store, step_dir, sel)
        rng = restore_mod.rng_of(manifest, contents) if sel.restores_rng else None
        if rng is not None and manifest.world_size == 1:  # per-rank RNG of a distributed run: see distributed/runtime.py
            restore_rng(rng)
        box = [contents, rng]
        del contents, rng
        restore_mod.drop_later(box)  # the read buffers are freed off this thread
        self.schedule.mark_saved()
        warn_left(left)

    def restore_from(self, path: str | os.PathLike[str], selection: Selection, storage_options: dict[str, Any] | None = None,
                     step: int | None = None) -> None:
        """Load the checkpoint at ``path`` (anything :func:`checkpointd.load` reads) into the chosen entries.

        Touches neither the roots nor the schedule. Under torch.distributed every rank loads the full
        values and the ranks agree that all could before any applies them.
        """
        source = os.fspath(path)

        def read() -> tuple[dict[str, Any], list[str]]:
            return by_registered_name(self.entries, load(path, step=step, storage_options=storage_options), source)

        if self.dist is not None:
            self.dist.restore_loaded(read, source, selection)
            return
        values, available = read()
        warn_left(restore_mod.restore_values(selection, values, source, available))


def by_registered_name(entries: list[Entry], loaded: Any, source: str) -> tuple[dict[str, Any], list[str]]:
    """``(values by registered name, every entry name the checkpoint holds)`` from ``checkpointd.load``'s dict.

    A registered name the checkpoint lacks is looked up under its PhysicsNeMo name (a module's file
    stem such as ``FullyConnected``, ``optimizer_state_dict`` for the optimizer, ...), so a PhysicsNeMo
    directory restores into ``{"model": ..., "optimizer": ...}``; a module found under neither takes the
    top-level keys that are its own parameter and buffer names (TorchTitan's DCP checkpoints flatten
    the model's state dict into the top level).
    """
    if not isinstance(loaded, dict):
        raise StateMismatchError(f"{source} holds a {type(loaded).__name__}, not a checkpoint of named state entries; "
                                 "restore_from reads a checkpointd root or step directory, a PhysicsNeMo or DCP directory")
    names = {e.name for e in entries}
    values: dict[str, Any] = {}
    used: set[str] = set()
    for e in entries:
        alias = e.file_stem if e.kind == "module" else e.key
        if e.name in loaded:
            values[e.name] = loaded[e.name]
            used.add(e.name)
        elif alias is not None and alias in loaded and alias not in names:
            values[e.name] = loaded[alias]
            used.add(alias)
    for e in entries:  # TorchTitan's DCP checkpoints hold the model's keys flattened into the top level
        if e.kind == "module" and e.name not in values:
            module = unwrap_module(e.obj)
            keys = [clean_fqn(n) for n, _ in (*module.named_parameters(), *module.named_buffers())]
            flat = {k: loaded[k] for k in keys if k in loaded and k not in used and k not in names}
            if flat:
                values[e.name] = flat
                used.update(flat)
    return values, sorted(set(values) | {str(k) for k in loaded if k not in used})


def warn_left(left: list[str]) -> None:
    """The one RuntimeWarning of a non-strict restore that left something as it is."""
    if left:
        warnings.warn("checkpointd: " + "; ".join(left), RuntimeWarning, stacklevel=4)


__all__ = ["Restorer", "by_registered_name", "warn_left"]
