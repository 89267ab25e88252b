"""Test helpers for checkpointd and its users: fault injection, a local S3 server, a tiny disk.

Nothing here is imported by the library itself (``faulty://`` is registered lazily by
:mod:`checkpointd.storage.store`), so these helpers cost nothing in production.
"""

from __future__ import annotations

from checkpointd.testing.faults import (
    Fault,
    FaultPlan,
    FaultyFileSystem,
    InjectedFault,
    SmallFilesystemUnavailable,
    disk_full_error,
    permanent_error,
    small_filesystem,
    timeout_error,
    transient_error,
)
from checkpointd.testing.s3server import S3Server, S3ServerError, find_weed, start_s3_server

__all__ = [
    "Fault",
    "FaultPlan",
    "FaultyFileSystem",
    "InjectedFault",
    "S3Server",
    "S3ServerError",
    "SmallFilesystemUnavailable",
    "disk_full_error",
    "find_weed",
    "permanent_error",
    "small_filesystem",
    "start_s3_server",
    "timeout_error",
    "transient_error",
]
