"""The lease file of a checkpoint root on disk: who holds it (a process's identity and whether it is
still alive) and, on local and network file systems, the lock file around every change to it.

No symbolic link is ever followed: a link at the lease or lock path is refused and nothing outside the
root is written. :mod:`checkpointd.lease` holds the protocol these serve.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import socket
import stat
import threading
import time
from collections.abc import Iterator
from typing import Any

from checkpointd.errors import RootInUseError
from checkpointd.storage.store import Store

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger("checkpointd")

LEASE_NAME = ".checkpointd-lease"
LOCK_NAME = ".checkpointd-lease.lock"
LOCK_WAIT_SECS = 10.0
"""How long to wait for the lock file; its critical sections take milliseconds."""
LEASE_FORMAT = 1
MAX_LEASE_BYTES = 64 * 1024
NO_FLOCK_ERRNOS = frozenset(
    getattr(errno, n) for n in ("ENOLCK", "EOPNOTSUPP", "ENOTSUP", "ENOSYS") if hasattr(errno, n)
)
O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)

_critical_lock = threading.RLock()
"""One lock-file critical section per process at a time (on NFS, flock is a per-process POSIX lock)."""
_tls = threading.local()
_warned_no_flock: set[str] = set()


class LockBusy(RootInUseError):
    """The lock file stayed locked by another process for ``LOCK_WAIT_SECS``."""


# -- who we are ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Identity:
    host: str
    boot_id: str | None
    pid_ns: str | None
    pid: int
    pid_start: int | None

    @classmethod
    def current(cls) -> Identity:
        pid = os.getpid()
        boot_id = pid_ns = None
        with contextlib.suppress(OSError):
            with open("/proc/sys/kernel/random/boot_id") as f:
                boot_id = f.read().strip() or None
        with contextlib.suppress(OSError):
            pid_ns = os.readlink("/proc/self/ns/pid")
        try:
            start = proc_start(pid)
        except ProcessLookupError:  # pragma: no cover - we are running
            start = None
        return cls(socket.gethostname(), boot_id, pid_ns, pid, start)

    def same_machine(self, doc: dict[str, Any]) -> bool:
        """Same host name, and same boot and pid namespace where both sides know them."""
        if doc.get("host") != self.host:
            return False
        for key, mine in (("boot_id", self.boot_id), ("pid_ns", self.pid_ns)):
            theirs = doc.get(key)
            if mine is not None and theirs is not None and theirs != mine:
                return False
        return True


def proc_start(pid: int) -> int | None:
    """Start time (clock ticks after boot, field 22 of /proc/<pid>/stat) of a running process.

    ``None`` where it cannot be read (no /proc, permissions). Raises ProcessLookupError for a process
    that is gone or a zombie.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except FileNotFoundError:
        if os.path.isdir("/proc/self"):
            signal_zero(pid)  # /proc mounted with hidepid hides other users' live processes
        return None
    except OSError:
        return None
    rest = data[data.rfind(b")") + 2:].split()  # the command name may hold spaces and parentheses
    if len(rest) < 20:
        return None
    if rest[0] in (b"Z", b"X", b"x"):
        raise ProcessLookupError(pid)
    return int(rest[19])


def signal_zero(pid: int) -> None:
    """Raises ProcessLookupError if no process ``pid`` exists."""
    try:
        os.kill(pid, 0)
    except PermissionError:
        pass  # it exists, under another user


def holder_gone(pid: int, recorded_start: Any) -> str | None:
    """Why process ``pid`` of this machine is not the holder that recorded ``recorded_start`` (None: it is)."""
    if pid <= 0:
        return f"its pid {pid} is invalid"
    try:
        start = proc_start(pid)
        if start is None:
            signal_zero(pid)
    except ProcessLookupError:
        return f"its process {pid} on this host is gone"
    if start is not None and isinstance(recorded_start, int) and start != recorded_start:
        return f"its process {pid} on this host is gone (the pid now belongs to a newer process)"
    return None


def parse_lease(raw: bytes | None) -> dict[str, Any] | None:
    """The lease document, or None when it is malformed."""
    if not raw:
        return None
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(doc, dict):
        return None
    ok = (isinstance(doc.get("owner"), str) and isinstance(doc.get("host"), str)
          and isinstance(doc.get("pid"), int) and isinstance(doc.get("heartbeat"), (int, float))
          and isinstance(doc.get("timeout"), (int, float)) and doc["timeout"] > 0)
    return doc if ok else None


def read_lease(store: Store) -> dict[str, Any] | None:
    """The lease document of ``store``'s root (e.g. to show who writes there); None if absent or unreadable.

    Local roots: a symbolic link at the lease path is not followed (read as absent).
    """
    try:
        if store.is_local:
            return parse_lease(local_read(store))
        return parse_lease(store.read_bytes(LEASE_NAME))
    except (FileNotFoundError, RootInUseError):
        return None


# -- local file primitives (no symbolic link is ever followed) ----------------------------------
def symlink_error(store: Store, name: str) -> RootInUseError:
    return RootInUseError(
        f"{store.display(name)} is a symbolic link or not a regular file; checkpointd does not follow links "
        f"there and will not save into {store.display()} while it exists. Remove it (nothing writes that "
        "name but checkpointd), then save again."
    )


def open_nofollow(store: Store, name: str, flags: int, mode: int = 0o644) -> int:
    path = store.path(name)
    try:
        fd = os.open(path, flags | O_NOFOLLOW | O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK) or (exc.errno == errno.EISDIR or os.path.islink(path)):
            raise symlink_error(store, name) from exc
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise symlink_error(store, name)
    return fd


def local_read(store: Store) -> bytes | None:
    try:
        fd = open_nofollow(store, LEASE_NAME, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    try:
        chunks: list[bytes] = []
        size = 0
        while size <= MAX_LEASE_BYTES and (chunk := os.read(fd, MAX_LEASE_BYTES + 1)):
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)  # an oversized lease fails to parse: read as unreadable
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def local_create(store: Store, data: bytes) -> bool:
    """Create the lease file with ``data``; False if something is at its path already."""
    try:
        fd = os.open(store.path(LEASE_NAME), os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0o644)
    except FileExistsError:
        return False
    try:
        write_all(fd, data)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(store.path(LEASE_NAME))
        raise
    os.close(fd)
    return True


def local_replace(store: Store, data: bytes, owner: str) -> None:
    """Atomically replace the lease file (a link at its path is replaced, never followed)."""
    tmp_name = f"{LEASE_NAME}.{owner}.tmp"
    tmp = store.path(tmp_name)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # our own leftover (a link there is removed, not followed)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0o644)
    try:
        try:
            write_all(fd, data)
        finally:
            os.close(fd)
        os.replace(tmp, store.path(LEASE_NAME))
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def critical(store: Store, remove_lock: bool = False) -> Iterator[bool]:
    """Hold the root's lock file (local stores); yields whether changes are mutually exclusive.

    ``remove_lock``: unlink the lock file before unlocking it (the last release of a lease, so that a
    root keeps no lock file while nobody writes it). Safe for others waiting on it: whoever gets the
    flock checks that the path still names the file it locked, and starts over if not.
    """
    if store.is_local:
        store.makedirs("")
    if not store.is_local or fcntl is None:
        yield False
        return
    with _critical_lock:
        while True:
            fd = open_nofollow(store, LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK)
            try:
                locked = flock_wait(fd, store)
                if not locked or still_named(fd, store):
                    break
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)  # unlinked (or replaced) by the holder we waited for: lock the current one
        try:
            _tls.depth = getattr(_tls, "depth", 0) + 1
            try:
                yield locked
            finally:
                _tls.depth -= 1
                if remove_lock and locked:
                    with contextlib.suppress(OSError):
                        os.unlink(store.path(LOCK_NAME))
        finally:
            os.close(fd)  # releases the flock


def still_named(fd: int, store: Store) -> bool:
    """Whether the lock file's path still names the file open as ``fd``."""
    try:
        st = os.stat(store.path(LOCK_NAME), follow_symlinks=False)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def flock_wait(fd: int, store: Store) -> bool:
    deadline = time.monotonic() + LOCK_WAIT_SECS
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise LockBusy(
                    f"{store.display(LOCK_NAME)} stayed locked for {LOCK_WAIT_SECS:.0f} s by another process "
                    f"(a writer of {store.display()} stopped or stuck in I/O); try again, or stop that writer"
                ) from None
            time.sleep(0.005)
        except OSError as exc:
            if exc.errno not in NO_FLOCK_ERRNOS:
                raise
            if store.root not in _warned_no_flock:
                _warned_no_flock.add(store.root)
                logger.warning("checkpointd: flock is not supported under %s (%s); the lease on this root is "
                               "best-effort, as on object stores", store.display(), exc)
            return False


def in_critical_section() -> bool:
    return getattr(_tls, "depth", 0) > 0
