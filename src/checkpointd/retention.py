"""Applying retention: delete committed steps the policy drops, and uncommitted leftovers.

The decision is the pure ``policy.RetentionPolicy``; this module does the I/O, on the committer
thread, after a commit. Invariants (SPEC §2): only committed steps count; the newest committed step
and every step in flight are never deleted; a committed step is deleted marker first
(``commit.uncommit_and_remove``), so a crash mid-delete never leaves a "committed" husk, and on local
targets its large files go to the recycling bin for the next save to overwrite (``recycle``); uncommitted
directories are removed only below the step just committed (a higher one may belong to a save that
another rank or process is still writing), and only when they hold no valid marker (a step whose
manifest no longer matches its marker is damage to inspect, not a leftover).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping

from checkpointd.storage import recyclebin
from checkpointd import commit
from checkpointd.format import layout
from checkpointd.storage import recycle
from checkpointd.errors import CheckpointError
from checkpointd.policy import RetentionPolicy
from checkpointd.storage.store import Store

logger = logging.getLogger("checkpointd")


def apply_retention(store: Store, policy: RetentionPolicy, just_committed: int, protected: set[int],
                    metrics_of: Callable[[list[int]], Mapping[int, Mapping[str, Any]]] | None = None,
                    ignored: frozenset[int] = frozenset()) -> list[int]:
    """Delete what ``policy`` drops under ``store``; returns the committed steps deleted.

    Args:
        just_committed: the step whose commit triggered this pass; never deleted.
        protected: steps in flight (or waiting for upload) that must survive whatever the policy says.
        metrics_of: metrics per committed step, needed only by ``keep_best``.
        ignored: committed steps neither counted nor deleted (those of the run a restore branched from).
    """
    dirs = commit.list_step_dirs(store)
    all_committed = commit.committed_steps(store)
    committed = [s for s in all_committed if s not in ignored]
    protected = protected | {just_committed}
    metrics = metrics_of(committed) if (policy.needs_metrics and metrics_of is not None) else None
    keep = policy.steps_to_keep(committed, metrics)
    newest = max(committed) if committed else None
    deleted = []
    retirement = None
    for s in committed:
        if s not in keep and s not in protected and s != newest:
            if retirement is None and recyclebin.enabled(store):
                retirement = recycle.Retirement(store, dirs.get(just_committed, layout.step_dir_name(just_committed)))
            commit.uncommit_and_remove(store, dirs.get(s, layout.step_dir_name(s)),
                                       recycle=retirement.retire if retirement is not None else None)
            deleted.append(s)
    # leftovers of crashed saves (no valid marker); a step whose marker is valid but whose manifest no
    # longer matches it is damaged, not a leftover: it stays for inspection (``checkpointd verify`` names it)
    keep_dirs = set(all_committed) | set(commit.marked_steps(store))
    for s, name in dirs.items():
        if s not in keep_dirs and s not in protected and s < just_committed:
            store.remove_tree(name)
    return deleted


class MetricsCache:
    """Metrics of committed steps for ``keep_best``: recorded at commit, read from manifests once otherwise."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._metrics: dict[int, dict[str, Any]] = {}

    def record(self, step: int, metrics: Mapping[str, Any]) -> None:
        self._metrics[step] = dict(metrics)

    def __call__(self, steps: list[int]) -> dict[int, dict[str, Any]]:
        out = {}
        for s in steps:
            if s not in self._metrics:
                try:
                    self._metrics[s] = commit.read_committed_manifest(self._store, layout.step_dir_name(s)).metrics
                except CheckpointError as exc:
                    logger.warning("checkpointd: cannot read metrics of step %d: %s", s, exc)
                    self._metrics[s] = {}
            out[s] = self._metrics[s]
        return out
