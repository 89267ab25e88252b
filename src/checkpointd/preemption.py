"""Preemption: a signal (SLURM's ``--signal``, Kubernetes' SIGTERM) makes the next ``maybe_save`` save.

A scheduler about to kill a job sends a signal first: SLURM ``--signal=B:USR1@120`` sends SIGUSR1 two
minutes before the time limit, Kubernetes sends SIGTERM and waits ``terminationGracePeriodSeconds``.
The handler here only sets a flag (a handler runs between two bytecodes of the main thread, so it must
not save, lock or allocate pinned memory itself); the training thread's next ``maybe_save`` sees the
flag, saves that step whatever the schedule says, and ``close(timeout)`` flushes it.

Limits: Python installs signal handlers in the main thread only; a manager built elsewhere raises
``ConfigError``. Handlers that were installed before are chained (called after ours); the default
action of SIGTERM/SIGUSR1 (terminate) is *not* chained, since terminating is what the save is for;
the training loop ends itself once ``CheckpointManager.preempted`` is True.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterable
from types import FrameType
from typing import Any

from checkpointd.errors import ConfigError

__all__ = ["DEFAULT_PREEMPTION_SIGNALS", "PreemptionWatcher"]

logger = logging.getLogger("checkpointd")

DEFAULT_PREEMPTION_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGUSR1)
"""What ``save_on_signals=True`` means: Kubernetes' SIGTERM and the usual SLURM ``--signal`` choice."""


class PreemptionWatcher:
    """Installs handlers for ``signals`` that record the signal; :meth:`uninstall` puts the old ones back.

    Args:
        signals: signal numbers (or ``signal.Signals``) to watch.

    Raises:
        ConfigError: not on the main thread, or a signal that cannot be caught (SIGKILL, SIGSTOP).
    """

    def __init__(self, signals: Iterable[int]) -> None:
        self.signals = tuple(signal.Signals(s) for s in signals)
        self.received: signal.Signals | None = None
        """The first signal received (None: none yet). Stays set: the run is being preempted."""
        self.save_pending = False
        """A signal arrived and the save it asks for has not started; the manager clears it."""
        self._previous: dict[signal.Signals, Any] = {}
        if threading.current_thread() is not threading.main_thread():
            raise ConfigError(
                "save_on_signals needs the CheckpointManager to be built on the main thread (Python runs signal "
                "handlers there only); build it there, or pass save_on_signals=() and call maybe_save(step, force=True) "
                "from your own handler's flag"
            )
        try:
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        except (ValueError, OSError) as exc:
            self.uninstall()
            raise ConfigError(f"cannot watch signal(s) {[s.name for s in self.signals]}: {exc}") from exc

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signal.Signals(signum)
        self.save_pending = True  # no logging here: a handler must not take locks the main thread may hold
        previous = self._previous.get(signal.Signals(signum))
        if callable(previous):  # chain a Python-level handler installed before ours
            previous(signum, frame)

    def uninstall(self) -> None:
        """Put back the handlers found at construction (main thread only; idempotent)."""
        if threading.current_thread() is not threading.main_thread():
            logger.warning("checkpointd: preemption handlers not restored (close() was not called on the main thread)")
            return
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._handle:
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()


def resolve_signals(save_on_signals: Any) -> tuple[int, ...]:
    """``True`` -> the defaults, ``False``/``None``/``()`` -> none, else the given signals."""
    if save_on_signals is True:
        return DEFAULT_PREEMPTION_SIGNALS
    if not save_on_signals:
        return ()
    if isinstance(save_on_signals, int):
        return (save_on_signals,)
    try:
        return tuple(signal.Signals(s) for s in save_on_signals)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"save_on_signals must be True, False or signal numbers, got {save_on_signals!r}") from exc
