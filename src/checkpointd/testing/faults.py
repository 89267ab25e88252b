"""Fault injection: an fsspec filesystem that wraps another and fails on a plan.

Why a filesystem and not a mock: the public API takes a root URL and ``storage_options``, so a
test (or the hidden harness) can run the real ``CheckpointManager`` on ``faulty://`` and see exactly
what a user would see when storage misbehaves:

    plan = FaultPlan(Fault(op="write", probability=0.2), seed=1)
    mgr = CheckpointManager("faulty:///tmp/run", state,
                            storage_options={"target_protocol": "file", "faults": plan})
    # S3: root "faulty://bucket/run",
    #     storage_options={"target_protocol": "s3", "target_options": s3_options, "faults": plan}

The plan is shared by reference (the filesystem is never cached by fsspec), so a test can change it
mid-run (``plan.enabled = False``, ``plan.free_disk()``) and read what happened (``plan.injected``,
``plan.calls``). Importing :mod:`checkpointd.storage.store` registers the ``faulty`` protocol lazily; this
module registers it eagerly too.

Operations a :class:`Fault` can target (``op``):

    "open"   opening a file for writing           "info"  info/exists/isfile/size
    "write"  each write() call on such a file     "ls"    listing a directory
    "close"  close(), the moment a file commits   "rm"    rm/rm_file
    "read"   opening for reading, cat_file         "*"     any of the above

A failed ``close`` aborts the target file (nothing appears), like a failed S3 multipart completion,
unless the fault says ``lands=True`` (the object is committed, then the error is raised: a lost ack).
Disk full is ``FaultPlan(disk_capacity_bytes=N)``: writes raise ``OSError(ENOSPC)`` once N bytes in
total were written through the plan, until ``plan.free_disk()``. For the real thing (the kernel's
ENOSPC, fsync included), :func:`small_filesystem` mounts a tiny tmpfs; it needs root.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fnmatch
import os
import random
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any

import fsspec
from fsspec import AbstractFileSystem

from checkpointd.storage.writerbase import WriterBase
from checkpointd.storage.writers import GuardedFile

__all__ = [
    "OPS",
    "Fault",
    "FaultPlan",
    "FaultyFileSystem",
    "InjectedFault",
    "SmallFilesystemUnavailable",
    "disk_full_error",
    "permanent_error",
    "small_filesystem",
    "timeout_error",
    "transient_error",
]

OPS = frozenset({"open", "write", "close", "read", "info", "ls", "rm"})

ErrorFactory = Callable[[str, str], BaseException]
PathMatcher = str | re.Pattern[str] | Callable[[str], bool]


def transient_error(op: str, path: str) -> BaseException:
    """A connection reset: what a flaky network or an overloaded server gives; retried."""
    return ConnectionResetError(errno.ECONNRESET, f"injected transient fault on {op} {path}")


def timeout_error(op: str, path: str) -> BaseException:
    return TimeoutError(errno.ETIMEDOUT, f"injected timeout on {op} {path}")


def permanent_error(op: str, path: str) -> BaseException:
    return PermissionError(errno.EACCES, f"injected permission error on {op} {path}")


def disk_full_error(op: str, path: str) -> BaseException:
    return OSError(errno.ENOSPC, f"No space left on device (injected, {op} {path})")


@dataclasses.dataclass(kw_only=True)
class Fault:
    """One rule of a :class:`FaultPlan`: which calls fail, and how.

    A call matches when its operation is in ``op`` and its path matches ``path``. Of the matching
    calls, the ``nth`` one fails (1-based, counted per fault), or, without ``nth``, each fails with
    ``probability``; at most ``times`` failures in all.
    """

    op: str | Collection[str] = "write"
    """Operation name(s) from :data:`OPS`, or "*" for all."""
    path: PathMatcher | None = None
    """A glob on the full path ("*/COMMITTED"), a compiled regex (search), a predicate, or None (any)."""
    nth: int | None = None
    """Fail only the n-th matching call (1-based)."""
    probability: float = 1.0
    """Without ``nth``: chance that a matching call fails (drawn from the plan's seeded RNG)."""
    times: int | None = None
    """Stop after this many failures (None: no limit)."""
    delay_secs: float = 0.0
    """Sleep this long before failing (a slow or hanging backend); with ``error=None`` only sleep."""
    error: ErrorFactory | None = transient_error
    """``factory(op, path)`` making the exception to raise; None makes the fault a pure delay."""
    lands: bool = False
    """For ``close``: commit the object first, then raise (the write landed but the ack was lost)."""

    def __post_init__(self) -> None:
        ops = {self.op} if isinstance(self.op, str) else set(self.op)
        unknown = ops - OPS - {"*"}
        if unknown:
            raise ValueError(f"unknown fault op(s) {sorted(unknown)}; choose from {sorted(OPS)} or '*'")
        if self.nth is not None and self.nth < 1:
            raise ValueError(f"nth is 1-based, got {self.nth}")
        if not 0.0 <= self.probability <= 1.0:
            raise ValueError(f"probability must be in [0, 1], got {self.probability}")
        self._ops = frozenset(OPS if "*" in ops else ops)
        self._matched = 0
        self._fired = 0

    def matches(self, op: str, path: str) -> bool:
        if op not in self._ops:
            return False
        if self.path is None:
            return True
        if isinstance(self.path, str):
            return fnmatch.fnmatchcase(path, self.path)
        if isinstance(self.path, re.Pattern):
            return self.path.search(path) is not None
        return bool(self.path(path))


@dataclasses.dataclass(frozen=True)
class InjectedFault:
    """A record of one injected failure (or delay)."""

    op: str
    path: str
    error: BaseException | None


class FaultPlan:
    """The faults to inject, shared by every ``faulty://`` filesystem that is given it.

    Args:
        *faults: the rules, checked in order; the first that fires decides.
        seed: seed of the RNG behind ``Fault.probability`` (reproducible runs).
        disk_capacity_bytes: simulate a disk of this size: writes raise ENOSPC once the bytes
            written through the plan would exceed it (None: unlimited).

    Attributes:
        enabled: set False to let every call through (the plan keeps counting).
        calls: Counter of calls per op.
        injected: every injected fault, in order.
        bytes_written: bytes accepted by ``write`` so far (since the last ``free_disk``).

    Thread-safe.
    """

    def __init__(self, *faults: Fault, seed: int = 0, disk_capacity_bytes: int | None = None) -> None:
        self.faults = list(faults)
        self.enabled = True
        self.disk_capacity_bytes = disk_capacity_bytes
        self.calls: Counter[str] = Counter()
        self.injected: list[InjectedFault] = []
        self.bytes_written = 0
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"FaultPlan({len(self.faults)} faults, injected={len(self.injected)}, enabled={self.enabled})"

    def add(self, fault: Fault) -> Fault:
        with self._lock:
            self.faults.append(fault)
        return fault

    def clear(self) -> None:
        """Remove every fault (the disk capacity stays)."""
        with self._lock:
            self.faults.clear()

    def free_disk(self, capacity_bytes: int | None = None) -> None:
        """Space is back: reset the written-bytes count (and optionally change the capacity)."""
        with self._lock:
            self.bytes_written = 0
            if capacity_bytes is not None:
                self.disk_capacity_bytes = capacity_bytes

    def failures(self, op: str | None = None) -> list[InjectedFault]:
        """Injected failures (delays excluded), optionally of one op."""
        return [f for f in self.injected if f.error is not None and (op is None or f.op == op)]

    def check(self, op: str, path: str) -> BaseException | None:
        """Count the call; sleep and/or raise if a fault fires.

        Returns the error of a fired ``lands=True`` close fault instead of raising it: the caller
        commits the object first, then raises it.
        """
        fired, error = self._decide(op, path)
        if fired is None:
            return None
        if fired.delay_secs:
            time.sleep(fired.delay_secs)
        if error is not None and op == "close" and fired.lands:
            return error
        if error is not None:
            raise error
        return None

    def account_write(self, path: str, nbytes: int) -> None:
        """Disk full simulation: raise ENOSPC if ``nbytes`` more do not fit."""
        with self._lock:
            cap = self.disk_capacity_bytes
            if self.enabled and cap is not None and self.bytes_written + nbytes > cap:
                error = disk_full_error("write", path)
                self.injected.append(InjectedFault("write", path, error))
                raise error
            self.bytes_written += nbytes

    def _decide(self, op: str, path: str) -> tuple[Fault | None, BaseException | None]:
        with self._lock:
            self.calls[op] += 1
            if not self.enabled:
                return None, None
            for fault in self.faults:
                if not fault.matches(op, path):
                    continue
                fault._matched += 1
                if fault.times is not None and fault._fired >= fault.times:
                    continue
                if fault.nth is not None:
                    hit = fault._matched == fault.nth
                else:
                    hit = fault.probability >= 1.0 or self._rng.random() < fault.probability
                if not hit:
                    continue
                fault._fired += 1
                error = fault.error(op, path) if fault.error is not None else None
                self.injected.append(InjectedFault(op, path, error))
                return fault, error
            return None, None


class FaultyFileSystem(AbstractFileSystem):
    """``faulty://<target path>``: every call goes to a target filesystem, through a FaultPlan.

    Args:
        target_protocol: protocol of the target ("file", "memory", "s3", ...).
        target_options: storage options of the target.
        fs: an existing target filesystem (instead of protocol and options).
        faults: the plan; default an empty plan (nothing fails).

    Paths are the target's paths: ``faulty:///tmp/run`` is ``/tmp/run`` on "file",
    ``faulty://bucket/run`` is ``bucket/run`` on "s3".
    """

    protocol = ("faulty",)
    cachable = False  # the plan is state; never share an instance between roots by accident

    def __init__(
        self,
        target_protocol: str = "file",
        target_options: dict[str, Any] | None = None,
        fs: AbstractFileSystem | None = None,
        faults: FaultPlan | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.pop("fo", None)
        super().__init__(**kwargs)
        self.target = fs if fs is not None else fsspec.filesystem(target_protocol, **(target_options or {}))
        self.plan = faults if faults is not None else FaultPlan()

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        path = str(path)
        if path.startswith("faulty://"):
            path = path[len("faulty://"):]
        return path.rstrip("/") or "/"

    def _t(self, path: str) -> str:
        return self.target._strip_protocol(self._strip_protocol(path))

    # -- hook used by checkpointd.storage.store.Store: faults around the Store's own best writer ----
    def wrap_write_file(self, path: str, opener: Callable[[], Any]) -> Any:
        """``opener()`` opens the target writer; faults for open/write/close wrap it."""
        self.plan.check("open", path)
        return _FaultyWriter(self.plan, path, opener())

    # -- AbstractFileSystem --------------------------------------------------------------------
    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        path = self._t(path)
        if "r" in mode and "+" not in mode:
            self.plan.check("read", path)
            return self.target.open(path, mode, **kwargs)
        self.plan.check("open", path)  # a guarded file: plain fsspec files commit on exceptions
        return _FaultyWriter(self.plan, path, GuardedFile(self.target, path))

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        path = self._t(path)
        self.plan.check("read", path)
        return self.target.cat_file(path, start=start, end=end, **kwargs)

    def pipe_file(self, path: str, value: bytes, **kwargs: Any) -> None:
        with self.open(path, "wb") as f:
            f.write(value)

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        path = self._t(path)
        self.plan.check("info", path)
        return self.target.info(path, **kwargs)

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        path = self._t(path)
        self.plan.check("ls", path)
        return self.target.ls(path, detail=detail, **kwargs)

    def find(self, path: str, maxdepth: int | None = None, withdirs: bool = False, detail: bool = False,
             **kwargs: Any) -> Any:
        """The target's own ``find`` (one prefix listing on object stores), counted as one "ls"."""
        path = self._t(path)
        self.plan.check("ls", path)
        return self.target.find(path, maxdepth=maxdepth, withdirs=withdirs, detail=detail, **kwargs)

    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> None:
        paths = [path] if isinstance(path, str) else list(path)
        for p in paths:
            p = self._t(p)
            self.plan.check("rm", p)
            self.target.rm(p, recursive=recursive, maxdepth=maxdepth)

    def rm_file(self, path: str) -> None:
        path = self._t(path)
        self.plan.check("rm", path)
        self.target.rm_file(path)

    def _rm(self, path: str) -> None:
        self.rm_file(path)

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        self.target.mkdir(self._t(path), create_parents=create_parents, **kwargs)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self.target.makedirs(self._t(path), exist_ok=exist_ok)

    def invalidate_cache(self, path: str | None = None) -> None:
        self.target.invalidate_cache(self._t(path) if path is not None else None)


class _FaultyWriter(WriterBase):
    """A Store writer (or guarded fsspec file) with faults on write() and close()."""

    def __init__(self, plan: FaultPlan, path: str, raw: Any) -> None:
        self._plan = plan
        self._path = path
        self._raw = raw
        self.closed = False

    def write(self, data: Any) -> int:
        try:
            self._plan.check("write", self._path)
            self._plan.account_write(self._path, memoryview(data).nbytes)
        except BaseException:
            self.abort()  # a failed write leaves nothing behind, like the Store's own writers
            raise
        return self._raw.write(data)

    def tell(self) -> int:
        return self._raw.tell()

    def flush(self) -> None:
        self._raw.flush()

    def close(self) -> None:
        if self.closed:
            return
        try:
            lost_ack = self._plan.check("close", self._path)
        except BaseException:
            self.abort()
            raise
        self.closed = True
        self._raw.close()
        if lost_ack is not None:
            raise lost_ack  # the object is committed, yet the caller sees a failure

    def abort(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._raw.abort()


fsspec.register_implementation("faulty", FaultyFileSystem, clobber=True)


# -- a real small filesystem ----------------------------------------------------------------------
class SmallFilesystemUnavailable(OSError):
    """No small filesystem can be mounted here (not root, no CAP_SYS_ADMIN, or no ``mount``)."""


@contextlib.contextmanager
def small_filesystem(size_bytes: int, parent: str | os.PathLike[str] | None = None) -> Iterator[Path]:
    """Mount a tmpfs of ``size_bytes`` on a fresh directory; yield it; unmount and remove it.

    A real disk-full test: writes past the size fail with ``OSError(ENOSPC)`` from the kernel, fsync
    included. Needs root (or CAP_SYS_ADMIN); tmpfs rounds the size up to whole pages.

    Raises:
        SmallFilesystemUnavailable: the mount failed; the message says why and how to skip.
    """
    if size_bytes <= 0:
        raise ValueError(f"size_bytes must be > 0, got {size_bytes}")
    mount = shutil.which("mount")
    umount = shutil.which("umount")
    if mount is None or umount is None:
        raise SmallFilesystemUnavailable(errno.ENOSYS, "`mount`/`umount` not found; install util-linux")
    mountpoint = Path(tempfile.mkdtemp(prefix="checkpointd-small-fs-", dir=parent))
    try:
        proc = subprocess.run(
            [mount, "-t", "tmpfs", "-o", f"size={size_bytes},mode=0777", "tmpfs", str(mountpoint)],
            capture_output=True, text=True, timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        mountpoint.rmdir()
        raise SmallFilesystemUnavailable(errno.EPERM, f"could not run mount: {exc}") from exc
    if proc.returncode != 0:
        mountpoint.rmdir()
        raise SmallFilesystemUnavailable(
            errno.EPERM,
            f"cannot mount a {size_bytes}-byte tmpfs (needs root or CAP_SYS_ADMIN): {proc.stderr.strip()}",
        )
    try:
        yield mountpoint
    finally:
        done = subprocess.run([umount, str(mountpoint)], capture_output=True, text=True, timeout=60)
        if done.returncode != 0:  # a file still open somewhere: detach now, freed when closed
            subprocess.run([umount, "-l", str(mountpoint)], capture_output=True, text=True, timeout=60)
        with contextlib.suppress(OSError):
            mountpoint.rmdir()
