"""When to save and what to keep: the two pure policies of the manager.

Both are plain functions of their inputs (steps, clock, metrics), with no I/O, so every rule of
SPEC §2 can be tested as a table.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

from checkpointd.errors import ConfigError


@dataclass(kw_only=True)
class SaveSchedule:
    """Decides whether ``maybe_save(step)`` saves.

    ``every_n_seconds`` counts from construction (or the last save): the first call saves only once
    that much wall time has passed.
    """

    every_n_steps: int | None = None
    every_n_seconds: float | None = None
    at_steps: frozenset[int] = frozenset()
    clock: Callable[[], float] = time.monotonic
    _last_save_time: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        if self.every_n_steps is not None and (not isinstance(self.every_n_steps, int) or self.every_n_steps <= 0):
            raise ConfigError(f"every_n_steps must be a positive int or None, got {self.every_n_steps!r}")
        if self.every_n_seconds is not None and not (
            isinstance(self.every_n_seconds, (int, float)) and self.every_n_seconds > 0 and math.isfinite(self.every_n_seconds)
        ):
            raise ConfigError(f"every_n_seconds must be a positive number or None, got {self.every_n_seconds!r}")
        for s in self.at_steps:
            if not isinstance(s, int) or s < 0:
                raise ConfigError(f"at_steps must hold non-negative ints, got {s!r}")
        self._last_save_time = self.clock()

    def is_due(self, step: int) -> bool:
        if step in self.at_steps:
            return True
        if self.every_n_steps is not None and step % self.every_n_steps == 0:
            return True
        if self.every_n_seconds is not None and self.clock() - self._last_save_time >= self.every_n_seconds:
            return True
        return False

    def mark_saved(self) -> None:
        self._last_save_time = self.clock()


@dataclass(frozen=True, kw_only=True)
class RetentionPolicy:
    """Which committed steps to keep (SPEC §2 "Retention").

    The newest committed step is always kept; so is anything in flight (the caller never passes
    in-flight steps as committed).
    """

    keep_last: int | None = 3
    keep_every_n_steps: int | None = None
    keep_best: int = 0
    best_metric: str | None = None
    best_mode: str = "min"

    def __post_init__(self) -> None:
        if self.keep_last is not None and (not isinstance(self.keep_last, int) or self.keep_last < 1):
            raise ConfigError(f"keep_last must be an int >= 1 or None (keep all), got {self.keep_last!r}")
        if self.keep_every_n_steps is not None and (
            not isinstance(self.keep_every_n_steps, int) or self.keep_every_n_steps <= 0
        ):
            raise ConfigError(f"keep_every_n_steps must be a positive int or None, got {self.keep_every_n_steps!r}")
        if not isinstance(self.keep_best, int) or self.keep_best < 0:
            raise ConfigError(f"keep_best must be an int >= 0, got {self.keep_best!r}")
        if self.keep_best and not self.best_metric:
            raise ConfigError("keep_best > 0 needs best_metric: the key in the metrics passed to maybe_save")
        if self.best_mode not in ("min", "max"):
            raise ConfigError(f"best_mode must be 'min' or 'max', got {self.best_mode!r}")

    @property
    def needs_metrics(self) -> bool:
        return self.keep_best > 0

    def steps_to_keep(self, committed: Iterable[int], metrics: Mapping[int, Mapping[str, object]] | None = None) -> set[int]:
        """The subset of ``committed`` to keep; everything else may be deleted."""
        steps = sorted(set(committed))
        if not steps:
            return set()
        if self.keep_last is None:
            return set(steps)
        keep = set(steps[-self.keep_last :])
        keep.add(steps[-1])
        if self.keep_every_n_steps:
            keep.update(s for s in steps if s % self.keep_every_n_steps == 0)
        if self.keep_best and metrics is not None:
            keep.update(self._best(steps, metrics))
        return keep

    def _best(self, steps: list[int], metrics: Mapping[int, Mapping[str, object]]) -> list[int]:
        scored = []
        for s in steps:
            value = (metrics.get(s) or {}).get(self.best_metric)  # type: ignore[arg-type]
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                scored.append((value if self.best_mode == "min" else -value, -s, s))
        scored.sort()
        return [s for _, _, s in scored[: self.keep_best]]
