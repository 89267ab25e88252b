"""Every environment variable checkpointd reads, in one place.

Everything else is a constructor option of :class:`checkpointd.CheckpointManager` or a constant of
the module that uses it. The environment is for switches an operator flips without touching the
training script:

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
from pathlib import Path

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
