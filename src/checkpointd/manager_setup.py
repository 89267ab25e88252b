"""Construction-time helpers of :class:`checkpointd.manager.CheckpointManager`.

Argument checks, opening a root's store, building the distributed runtime when torch.distributed is
initialized, and the interpreter-exit flush: each a few lines the manager calls once, kept here so
that ``manager.py`` reads as the loop-facing orchestration it is.
"""

from __future__ import annotations

import atexit
import logging
import operator
import os
import threading
import weakref
from typing import Any, Callable, Iterable

from checkpointd import distributed
from checkpointd.codecs.compress import Codec, get_codec
from checkpointd.distributed.runtime import DistributedRuntime
from checkpointd.errors import ConfigError
from checkpointd.native import planes as planes_native
from checkpointd.options import DistributedOptions, IOOptions, StagingOptions
from checkpointd.storage.retry import RetryPolicy
from checkpointd.storage.store import Store

logger = logging.getLogger("checkpointd")

VALID_MODES = ("full", "sharded")
"""The ``mode`` values: one full copy of the state, or one file set per rank (torch.distributed)."""


def check_arguments(mode: str, max_pending: Any, staging: Any, io: Any, dist: Any) -> None:
    """The manager's own argument checks (the option groups check their fields when built).

    Raises:
        ConfigError: naming the argument and what it takes.
    """
    if mode not in VALID_MODES:
        raise ConfigError(f"mode must be one of {VALID_MODES}, got {mode!r}")
    if isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending < 1:
        raise ConfigError(f"max_pending must be an int >= 1, got {max_pending!r}")
    for name, value, kind in (("staging", staging, StagingOptions), ("io", io, IOOptions),
                              ("distributed", dist, DistributedOptions)):
        if not isinstance(value, kind):
            raise ConfigError(f"{name} must be a checkpointd.{kind.__name__}, got {type(value).__name__}")
    check_host_budget(staging.host_budget_bytes, mode)


def check_host_budget(budget: int | None, mode: str) -> None:
    """A host staging budget streams each rank's own files: not with full-mode distributed saves."""
    if budget is not None and mode == "full" and distributed.is_active():
        raise ConfigError("StagingOptions.host_budget_bytes is not supported with mode='full' under torch.distributed "
                          "(rank 0 stages the gathered full state); use mode='sharded', whose per-rank files stream "
                          "through the budget, or drop the budget")


def register_flush_at_exit(flush: Callable[[], None]) -> Any:
    """Call the bound method ``flush`` at interpreter exit, while its object is alive.

    The manager's flush finishes the saves still in flight: without it the writer threads (daemons)
    die with the interpreter and a started save is silently not committed. Only a weak reference is
    kept, so an unclosed manager is still collected. Returns what ``atexit.unregister`` takes, or None
    where the hook needs no unregistering.
    """
    ref = weakref.WeakMethod(flush)  # type: ignore[arg-type]

    def at_exit() -> None:
        method = ref()
        if method is not None:
            method()

    # threading's exit hooks run (newest first) before concurrent.futures stops accepting work, and
    # before plain atexit handlers; fall back to atexit where that private hook does not exist.
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        register(at_exit)
        return None
    atexit.register(at_exit)
    return at_exit


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
    """``at_steps`` as a list of ints; ConfigError when it is not an iterable of ints."""
    try:
        return [int(s) if not isinstance(s, bool) else -1 for s in at_steps]
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"at_steps must be an iterable of ints, got {at_steps!r}") from exc


def open_store(root: Any, storage_options: dict[str, Any] | None, retry_timeout_secs: float) -> Store:
    """The store of a checkpoint root, retrying transient errors for ``retry_timeout_secs``.

    Raises:
        ConfigError: ``root`` is not a path or URL, or names a file.
    """
    if not isinstance(root, (str, os.PathLike)):
        raise ConfigError(f"root must be a path or URL string, got {type(root).__name__}")
    store = Store(root, storage_options, retry=RetryPolicy(max_elapsed_secs=retry_timeout_secs))
    if store.is_file(""):
        raise ConfigError(f"checkpoint root {store.display()} is a file; pass a directory (or a URL prefix)")
    return store


AUTO = "auto"


def choose_codec(compression: str | None, store: Store) -> Codec:
    """The codec a manager writes with; ``"auto"`` (the default) picks by where the files go first.

    Local roots (a disk, tmpfs, a mounted file system, and the local tier of two tiers) take bytes
    faster than the CPU compresses them (zstd: about 1 GB/s a core for a ratio of 1.1 on float state),
    and compressing takes those cores from the training process: there ``"auto"`` writes native
    files. Object stores and other remote roots are slower than the compressor and often billed by
    the byte: there it is ``"zstd-planes"``, which on float state both compresses more (1.2) and runs
    faster than plain zstd (``benchmarks/bench_s3.py``, ``bench_compression.py``), as long as its
    native kernels loaded. Without them (nothing could be compiled at install, or native code is
    turned off) its NumPy coder runs at a tenth of plain zstd's speed or less, and ``"auto"`` takes
    ``"zstd"`` (logged). Any other value is a codec name (``None`` for none).

    Raises:
        ConfigError: an unknown codec name.
    """
    if compression == AUTO:
        if store.is_local:
            return get_codec(None)
        if planes_native.library() is None:
            logger.warning("checkpointd: compression='auto' writes 'zstd' to %s: the native kernels of 'zstd-planes' "
                           "are not in use (%s), and its NumPy coder is too slow to keep up", store.display(),
                           planes_native.why_not)
            return get_codec("zstd")
        return get_codec("zstd-planes")
    try:
        return get_codec(compression)
    except ConfigError as exc:
        raise ConfigError(f"{exc}, or {AUTO!r} (the default)") from None


def distributed_runtime(entries: Any, mode: str, timeout_secs: float) -> DistributedRuntime | None:
    """A DistributedRuntime when torch.distributed is initialized (collective: every rank builds its manager)."""
    if not distributed.is_active():
        return None
    return DistributedRuntime(entries, mode, timeout_secs)


__all__ = ["VALID_MODES", "as_step", "as_steps", "check_arguments", "check_host_budget", "distributed_runtime",
           "open_store", "register_flush_at_exit"]
