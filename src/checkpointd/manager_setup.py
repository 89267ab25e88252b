"""Construction-time helpers of :class:`checkpointd.manager.CheckpointManager`.

Why a module of its own: argument checks, opening the store, finding the distributed runtime and the
PhysicsNeMo hooks, and the interpreter-exit flush are each a few lines that the manager calls once;
kept here, ``manager.py`` reads as the save/restore orchestration it is.
"""

from __future__ import annotations

import atexit
import errno
import logging
import operator
import os
import threading
import weakref
from typing import TYPE_CHECKING, Any, Iterable

from checkpointd.errors import CheckpointError, ConfigError
from checkpointd.storage.retry import RetryPolicy
from checkpointd.storage.store import Store

if TYPE_CHECKING:
    from checkpointd.manager import CheckpointManager

logger = logging.getLogger("checkpointd")


def register_flush_at_exit(mgr: "CheckpointManager") -> Any:
    """At interpreter exit, finish the saves a manager that was never closed still has in flight.

    Without it, the writer threads (daemons) die with the interpreter and a started save is silently
    not committed. Single-process only: in a distributed run the other ranks may already be gone.
    """
    ref = weakref.ref(mgr)

    def flush() -> None:
        m = ref()
        if m is None or m._closed or not len(m._inflight):
            return
        logger.warning("checkpointd: the manager was not closed; finishing %d save(s) before exit", len(m._inflight))
        try:
            m.close(timeout=m._exit_timeout_secs)
        except CheckpointError as exc:
            logger.error("checkpointd: a save could not be finished at exit: %s", exc)

    # threading's exit hooks run (newest first) before concurrent.futures stops accepting work, and
    # before plain atexit handlers; fall back to atexit where that private hook does not exist.
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        register(flush)
        return None
    atexit.register(flush)
    return flush


def check_host_budget(budget: Any, mode: str) -> None:
    """``host_staging_budget_bytes``: a positive int or None; not with full-mode distributed saves."""
    if budget is None:
        return
    if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
        raise ConfigError(f"host_staging_budget_bytes must be a positive int (bytes) or None, got {budget!r}")
    from checkpointd import distributed

    if mode == "full" and distributed.is_active():
        raise ConfigError("host_staging_budget_bytes is not supported with mode='full' under torch.distributed "
                          "(rank 0 stages the gathered full state); use mode='sharded', whose per-rank files stream "
                          "through the budget, or drop the budget")


def as_step(step: Any) -> int:
    """``step`` as a plain int (NumPy and other integer types accepted); ConfigError otherwise."""
    try:
        value = operator.index(step) if not isinstance(step, bool) else -1
    except TypeError:
        value = -1
    if value < 0:
        raise ConfigError(f"step must be a non-negative integer, got {step!r} ({type(step).__name__})")
    return value


def as_steps(at_steps: Iterable[int]) -> list[int]:
    try:
        return [int(s) if not isinstance(s, bool) else -1 for s in at_steps]
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"at_steps must be an iterable of ints, got {at_steps!r}") from exc


def failure_hint(exc: BaseException) -> str:
    """What to do about a background failure, for the causes that have an obvious remedy."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        return " The storage is full: free space (or lower keep_last) and the next save will succeed."
    if isinstance(exc, PermissionError):
        return " Check that this process may write to the checkpoint root."
    return ""


def open_store(root: Any, storage_options: dict[str, Any] | None, retry_timeout_secs: float) -> Store:
    if not isinstance(root, (str, os.PathLike)):
        raise ConfigError(f"root must be a path or URL string, got {type(root).__name__}")
    store = Store(root, storage_options, retry=RetryPolicy(max_elapsed_secs=retry_timeout_secs))
    if store.is_file(""):
        raise ConfigError(f"checkpoint root {store.display()} is a file; pass a directory (or a URL prefix)")
    return store


def distributed_runtime(entries: Any, mode: str, timeout_secs: float) -> Any:
    """A DistributedRuntime when torch.distributed is initialized (collective: every rank builds its manager)."""
    from checkpointd import distributed

    if not distributed.is_active():
        return None
    from checkpointd.distributed.runtime import DistributedRuntime

    return DistributedRuntime(entries, mode, timeout_secs)


def physicsnemo_detector() -> Any:
    try:
        from checkpointd.format.mdlus import is_physicsnemo_module

        return is_physicsnemo_module
    except ImportError:
        return None


def mdlus_members() -> Any:
    try:
        from checkpointd.format.mdlus import mdlus_json_members

        return mdlus_json_members
    except ImportError:
        return None


__all__ = ["as_step", "as_steps", "check_host_budget", "distributed_runtime", "failure_hint", "mdlus_members", "open_store", "physicsnemo_detector", "register_flush_at_exit"]
