"""Every environment variable checkpointd reads, in one place, and the manager's tuning options.

The tuning knobs of :class:`checkpointd.CheckpointManager` come in three frozen dataclasses, each
checked when built (a bad value raises ConfigError naming the field): :class:`StagingOptions` (how a
save leaves the device), :class:`IOOptions` (threads, retries, the root's lease) and
:class:`DistributedOptions` (torch.distributed coordination).

Everything else is a constructor argument of the manager or a constant of the module that uses it.
The environment is for switches an operator flips without touching the training script:

===============================  ==========================================================================
Variable                         Effect
===============================  ==========================================================================
``CHECKPOINTD_CACHE_DIR``        Folder for CUDA kernels compiled on first use (default
                                 ``$XDG_CACHE_HOME/checkpointd`` or ``~/.cache/checkpointd``).
``CHECKPOINTD_NATIVE``           ``0``: never load the package's native code; the pure Python / NumPy paths
                                 run instead (same bytes, slower).
``CHECKPOINTD_PERSIST_PROCESS``  ``0``: local files are written by threads of the training process, not by
                                 the persist process.
``CHECKPOINTD_RECYCLE``          ``0``: retired checkpoint files are deleted, not reused by later saves.
``CHECKPOINTD_IO_THREADS``       Size of the I/O thread pools (default: the core count, 4 to 32).
``CHECKPOINTD_RESTORE_VERIFY``   ``host``: checksum restored files on the CPU even when they go to a GPU
                                 (default ``device``: on the GPU they are copied to).
===============================  ==========================================================================
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from checkpointd.errors import ConfigError

CACHE_DIR_ENV = "CHECKPOINTD_CACHE_DIR"
NATIVE_ENV = "CHECKPOINTD_NATIVE"
PERSIST_PROCESS_ENV = "CHECKPOINTD_PERSIST_PROCESS"
RECYCLE_ENV = "CHECKPOINTD_RECYCLE"
IO_THREADS_ENV = "CHECKPOINTD_IO_THREADS"
RESTORE_VERIFY_ENV = "CHECKPOINTD_RESTORE_VERIFY"

_OFF = ("0", "false", "no", "off")


def _switch(name: str) -> bool:
    """A switch that is on unless the variable says ``0`` (or false/no/off)."""
    return os.environ.get(name, "").strip().lower() not in _OFF


def cache_dir() -> Path:
    """Where kernels compiled on first use are kept (``CHECKPOINTD_CACHE_DIR``)."""
    configured = os.environ.get(CACHE_DIR_ENV, "").strip()
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or str(Path.home() / ".cache")
    return Path(base) / "checkpointd"


def native_enabled() -> bool:
    """Whether native code may be loaded (``CHECKPOINTD_NATIVE``)."""
    return _switch(NATIVE_ENV)


def persist_process_enabled() -> bool:
    """Whether local files are written by the persist process (``CHECKPOINTD_PERSIST_PROCESS``)."""
    return _switch(PERSIST_PROCESS_ENV)


def recycle_enabled() -> bool:
    """Whether retired files are reused (``CHECKPOINTD_RECYCLE``)."""
    return _switch(RECYCLE_ENV)


def io_threads() -> int:
    """The I/O pools' size: ``CHECKPOINTD_IO_THREADS`` or ``min(32, max(4, cpu_count))``.

    Raises:
        ValueError: the variable is not a positive integer (the message names it).
    """
    raw = os.environ.get(IO_THREADS_ENV, "").strip()
    if not raw:
        return min(32, max(4, os.cpu_count() or 4))
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{IO_THREADS_ENV}={raw!r}: expected a positive integer")
    return value


def restore_verify_on() -> str:
    """``device`` (the default) or ``host`` (``CHECKPOINTD_RESTORE_VERIFY``).

    Raises:
        ValueError: any other value (the message names the variable).
    """
    raw = os.environ.get(RESTORE_VERIFY_ENV, "").strip().lower() or "device"
    if raw not in ("device", "host"):
        raise ValueError(f"{RESTORE_VERIFY_ENV}={raw!r}: expected 'device' or 'host'")
    return raw


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class StagingOptions:
    """How a save's tensors leave the device (``CheckpointManager(staging=...)``).

    Attributes:
        device_budget_bytes: opt-in device staging: when the CUDA tensors of a save fit in this many
            bytes of GPU memory, they are first cloned into a reused GPU buffer (~2 TB/s), so training
            never waits for the device-to-host copy. Costs that much GPU memory. None: off.
        host_budget_bytes: opt-in host budget: stage CUDA state through a fixed ring of pinned chunks
            totalling at most this many bytes (allocated once, reused) instead of one pinned buffer the
            size of the state. The writer streams the state through it; the optimizer step (and the
            registered modules' forward, for their buffers) waits on the host until every tensor left
            the device, which costs about (state - budget) / write bandwidth per save. With device
            staging also on and fitting, the stream reads the GPU copy and nothing waits. Ignored
            (logged) on CPU-only torch; rejected with ``mode="full"`` under torch.distributed.
        freeze_gc: collect, then ``gc.freeze()`` the objects alive at construction until the last
            manager closes, so that the full collections a save's objects trigger stay short (see
            ``save/gcfreeze.py``: otherwise one costs the training thread 60-180 ms every few saves).
    """

    device_budget_bytes: int | None = None
    host_budget_bytes: int | None = None
    freeze_gc: bool = True

    def __post_init__(self) -> None:
        device = self.device_budget_bytes
        if device is not None and (isinstance(device, bool) or not isinstance(device, int) or device < 0):
            raise ConfigError(f"StagingOptions.device_budget_bytes must be an int >= 0 or None, got {device!r}")
        host = self.host_budget_bytes
        if host is not None and (isinstance(host, bool) or not isinstance(host, int) or host <= 0):
            raise ConfigError(f"StagingOptions.host_budget_bytes must be a positive int (bytes) or None, got {host!r}")
        if not isinstance(self.freeze_gc, bool):
            raise ConfigError(f"StagingOptions.freeze_gc must be True or False, got {self.freeze_gc!r}")


@dataclass(frozen=True)
class IOOptions:
    """Threads, retries and the root's lease (``CheckpointManager(io=...)``).

    Attributes:
        file_threads: files written in parallel per save; None: the core count, 2 to 8.
        retry_timeout_secs: how long transient storage errors are retried before a save fails.
        lease_timeout_secs: one writer per root: the first save takes a lease on the root (and on
            ``local_dir``), renewed every quarter of this; a writer on another host whose lease was not
            renewed for this long is taken over (one on this host as soon as its process is gone). See
            ``lease.py``.
    """

    file_threads: int | None = None
    retry_timeout_secs: float = 120.0
    lease_timeout_secs: float = 60.0

    def __post_init__(self) -> None:
        threads = self.file_threads
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ConfigError(f"IOOptions.file_threads must be an int >= 1 or None, got {threads!r}")
        if not (_is_number(self.retry_timeout_secs) and self.retry_timeout_secs >= 0):
            raise ConfigError(f"IOOptions.retry_timeout_secs must be a number >= 0, got {self.retry_timeout_secs!r}")
        if not (_is_number(self.lease_timeout_secs) and self.lease_timeout_secs > 0):
            raise ConfigError(f"IOOptions.lease_timeout_secs must be a number > 0, got {self.lease_timeout_secs!r}")

    def threads(self) -> int:
        """``file_threads``, or its default for this machine."""
        return self.file_threads or min(8, max(2, os.cpu_count() or 2))


@dataclass(frozen=True)
class DistributedOptions:
    """torch.distributed coordination (``CheckpointManager(distributed=...)``).

    Attributes:
        timeout_secs: how long a rank waits for the others in the manager's own coordination (a dead
            rank fails the save after this, instead of hanging).
    """

    timeout_secs: float = 600.0

    def __post_init__(self) -> None:
        if not (_is_number(self.timeout_secs) and self.timeout_secs > 0):
            raise ConfigError(f"DistributedOptions.timeout_secs must be a number > 0, got {self.timeout_secs!r}")
