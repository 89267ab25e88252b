"""One writer per checkpoint root: the lease a saving manager holds on its root (SPEC §2).

Two processes saving into one root interleave their step directories, retention and leftover
cleanup, and commit steps whose files the other one replaced or deleted. A :class:`RootLease` makes
the second writer refuse instead, with :class:`~checkpointd.errors.RootInUseError` naming the holder.
Reading a root needs no lease.

The lease is the file ``<root>/.checkpointd-lease`` (not step-shaped, so listings ignore it), a JSON
document: ``owner`` (a uuid4 per lease), ``host``, ``boot_id`` and ``pid_ns`` (which machine and pid
namespace), ``pid``, ``pid_start`` (the process start time from ``/proc/<pid>/stat``), ``started``
and ``heartbeat`` (unix times), ``timeout`` (seconds), ``version`` (of checkpointd) and ``what``.
A daemon thread rewrites ``heartbeat`` every ``timeout / 4``; it holds no reference to the manager.

Taking over. A lease whose holder is live is never taken. The holder counts as gone when:

- it ran on this machine (same host name, boot id and pid namespace) and its pid is gone, a zombie,
  or belongs to a newer process (another start time: a reused pid). Taken over at once, so a job
  restarted after SIGKILL or preemption saves without waiting.
- it ran elsewhere and its heartbeat is older than the holder's own ``timeout``. Hosts' clocks must
  agree within a fraction of the timeout (heartbeats are compared with ``time.time()``).
- the lease file is unreadable (e.g. empty after a machine crash), or it names this process but no
  lease of this process holds it any more.

A host with the same name but another boot id or pid namespace (containers) counts as another host.

What each backend guarantees:

- **Local and network file systems.** Every change to the lease (create, take over, heartbeat,
  release) happens under an ``fcntl.flock`` on ``<root>/.checkpointd-lease.lock``; a lease is created
  with ``O_CREAT | O_EXCL`` and replaced by writing a temporary file and ``os.replace``. This gives
  mutual exclusion between processes of one host, and across hosts on NFS and clustered file systems
  whose ``flock`` works. Where ``flock`` is not supported, a warning is logged and the object store
  procedure below is used. Neither path follows a symbolic link: a link at the lease or lock path is
  refused and nothing outside the root is written.
- **Object stores** (S3, GCS, ``memory://``; no create-if-absent through fsspec in general):
  best-effort. Read the lease; if it is absent or its holder gone, write ours, wait ``settle_secs``,
  read it back and hold it only if it is still ours (else the winner is named). Two writers can both
  win only if one of them stalls between its read and its write for longer than the settle time;
  :meth:`RootLease.check` before each commit marker, and every heartbeat, then see the lease is not
  theirs and stop that writer.

Limits: a lease is not a fencing token. A holder suspended for longer than the timeout between its
:meth:`RootLease.check` and its marker write can still write that one marker after a writer on
another host took the root over. On one host a suspended (SIGSTOP) holder is still live and is never
taken over. Heartbeat I/O errors are logged and retried at the next beat, never raised into training;
a holder whose heartbeats fail for longer than the timeout can be taken over from another host.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import os
import threading
import time
import uuid
import weakref
from typing import Any

from checkpointd.errors import ConfigError, RootInUseError
from checkpointd.leasefile import (
    Identity,
    LEASE_FORMAT,
    LEASE_NAME,
    LockBusy,
    critical,
    holder_gone,
    in_critical_section,
    local_create,
    local_read,
    local_replace,
    parse_lease,
    )
from checkpointd.storage.store import Store
from checkpointd.version import VERSION

__all__ = ["DEFAULT_TIMEOUT_SECS", "RootLease"]

logger = logging.getLogger("checkpointd")

DEFAULT_TIMEOUT_SECS = 60.0
DEFAULT_SETTLE_SECS = 0.3

_live: dict[str, _LeaseState] = {}
"""Leases this process holds, by owner id: a lease file naming this process is live iff it is here."""
_live_lock = threading.Lock()


# -- the lease ----------------------------------------------------------------------------------
class _LeaseState:
    """Everything a lease needs; shared with its heartbeat thread. Holds no reference to its user."""

    def __init__(self, store: Store, timeout_secs: float, what: str, settle_secs: float) -> None:
        self.store = store
        self.timeout = float(timeout_secs)
        self.interval = self.timeout / 4
        self.what = what
        self.settle = float(settle_secs)
        self.owner = uuid.uuid4().hex
        self.me = Identity.current()
        self.pid = self.me.pid
        self.started = 0.0
        self.last_beat = 0.0
        self.held = False
        self.lost: str | None = None
        self.lock = threading.RLock()
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.beat_store = Store(store.root, fs=store.fs,
                                retry=dataclasses.replace(store.retry, max_elapsed_secs=min(
                                    store.retry.max_elapsed_secs, self.interval / 2)))

    # -- I/O ------------------------------------------------------------------------------------
    def read(self, store: Store | None = None) -> tuple[bool, dict[str, Any] | None]:
        """(whether a lease exists, its document or None if malformed)."""
        store = store or self.store
        if store.is_local:
            raw = local_read(store)
        else:
            try:
                raw = store.read_bytes(LEASE_NAME)
            except FileNotFoundError:
                raw = None
        return raw is not None, parse_lease(raw)

    def document(self, now: float) -> bytes:

        me = self.me
        return json.dumps({
            "format": LEASE_FORMAT, "owner": self.owner, "host": me.host, "boot_id": me.boot_id,
            "pid_ns": me.pid_ns, "pid": me.pid, "pid_start": me.pid_start, "started": self.started,
            "heartbeat": now, "timeout": self.timeout, "version": VERSION, "what": self.what,
        }, indent=1).encode()

    def ours(self, doc: dict[str, Any] | None) -> bool:
        return doc is not None and doc.get("owner") == self.owner

    # -- judging a holder -------------------------------------------------------------------------
    def in_this_process(self, doc: dict[str, Any]) -> bool:
        me = self.me
        return (me.same_machine(doc) and doc.get("pid") == me.pid
                and (doc.get("pid_start") is None or me.pid_start is None or doc.get("pid_start") == me.pid_start))

    def vacancy(self, exists: bool, doc: dict[str, Any] | None, now: float) -> str | None:
        """Why the lease may be taken (None: a live holder has it)."""
        if not exists:
            return "no lease"
        if doc is None:
            return f"the lease file {self.store.display(LEASE_NAME)} is unreadable"
        if self.in_this_process(doc):
            with _live_lock:
                other = _live.get(doc["owner"])
            if other is not None and other.held:
                return None
            return "it was left by this process and no lease of this process holds it"
        if self.me.same_machine(doc):
            return holder_gone(doc["pid"], doc.get("pid_start"))
        age = now - float(doc["heartbeat"])
        if age > float(doc["timeout"]):
            return f"its heartbeat is {age:.0f} s old (timeout {float(doc['timeout']):.0f} s)"
        return None

    def in_use(self, doc: dict[str, Any] | None, now: float) -> RootInUseError:
        where = self.store.display()
        if doc is None:
            return RootInUseError(f"checkpoint root {where} is being claimed by another writer at the same "
                                  f"time ({self.store.display(LEASE_NAME)}); one writer per root: stop the other one "
                                  "or save to another root")
        what = str(doc.get("what") or "writer")
        since = _when(doc.get("started"))
        if self.in_this_process(doc):
            return RootInUseError(
                f"checkpoint root {where} is in use by another {what} in this process (saving since "
                f"{since}); one writer per root: close that one (or drop every reference to it) before saving "
                "with a new one, or save to another root"
            )
        beat_age = max(0.0, now - float(doc["heartbeat"]))
        msg = (f"checkpoint root {where} is in use by another writer: {what} pid {doc['pid']} on host "
               f"{doc['host']}, saving since {since}, last heartbeat {beat_age:.1f} s ago (lease "
               f"{self.store.display(LEASE_NAME)}). One writer per root: wait for it to finish, stop it, or "
               "save to another root.")
        if not self.me.same_machine(doc):
            msg += (f" If it has stopped, its lease is taken over once its heartbeat is older than "
                    f"{float(doc['timeout']):.0f} s.")
        return RootInUseError(msg)

    # -- the protocol -----------------------------------------------------------------------------
    def acquire(self) -> None:
        with self.lock:
            if self.held and not self.lost:
                return
            self.held, self.lost = False, None
            exists, doc = self.read()
            if exists and doc is not None and not self.ours(doc) and self.in_this_process(doc):
                gc.collect()  # an unreferenced manager in a reference cycle releases its lease when collected
            for _ in range(3):
                if self._try_acquire():
                    self._hold()
                    return
            _, doc = self.read()
            raise self.in_use(doc, time.time())

    def _try_acquire(self) -> bool:
        """True once the lease is ours; False to try again (lost a create race); raises if a holder lives."""
        store = self.store
        with critical(store) as exclusive:
            now = time.time()
            exists, doc = self.read()
            if self.ours(doc):
                return True
            reason = self.vacancy(exists, doc, now)
            if reason is None:
                raise self.in_use(doc, now)
            if exists:
                holder = f"pid {doc['pid']} on host {doc['host']}" if doc else "an unknown holder"
                logger.warning("checkpointd: taking over the lease on %s from %s: %s", store.display(), holder, reason)
            self.started = now
            data = self.document(now)
            if store.is_local:
                if not exists:
                    if not local_create(store, data):
                        return False
                else:
                    local_replace(store, data, self.owner)
            else:
                store.write_bytes(LEASE_NAME, data)
            self.last_beat = now
        if exclusive:
            return True
        time.sleep(self.settle)  # let a writer that read the same state at the same time write too
        _, doc = self.read()
        if not self.ours(doc):
            raise self.in_use(doc, time.time())
        return True

    def _hold(self) -> None:
        self.held = True
        self.stop = threading.Event()  # one per hold: a thread of an earlier hold never beats again
        with _live_lock:
            _live[self.owner] = self
        self.thread = threading.Thread(target=_heartbeat_loop, args=(self, self.stop), daemon=True,
                                       name="checkpointd-lease-heartbeat")
        self.thread.start()

    def mark_lost(self, doc: dict[str, Any] | None, now: float) -> str:
        if doc is None:
            holder = f"the lease file {self.store.display(LEASE_NAME)} is gone or unreadable"
        else:
            holder = f"{doc.get('what') or 'a writer'} pid {doc['pid']} on host {doc['host']} holds it now"
        return self.lose(
            f"this {self.what} no longer holds the lease on checkpoint root {self.store.display()}: {holder}. "
            f"It stops committing so two writers do not mix their steps (its last heartbeat was "
            f"{max(0.0, now - self.last_beat):.0f} s ago; a lease is taken over from another host once its "
            f"heartbeat is older than {self.timeout:.0f} s, e.g. while this process was suspended or its "
            "storage unreachable). Stop one of the writers, then restart from latest_step()."
        )

    def lose(self, message: str) -> str:
        self.lost = message
        self.held = False
        self.stop.set()
        with _live_lock:
            _live.pop(self.owner, None)
        logger.error("checkpointd: %s", message)
        return message

    def check(self) -> None:
        with self.lock:
            if self.lost:
                raise RootInUseError(self.lost)
            if not self.held:
                self.acquire()
                return
            _, doc = self.read()
            if not self.ours(doc):
                raise RootInUseError(self.mark_lost(doc, time.time()))

    def beat(self, stop: threading.Event) -> None:
        """Rewrite the heartbeat (heartbeat thread); errors are logged, never raised."""
        with self.lock:
            if not self.held or stop.is_set():
                return
            store = self.beat_store
            try:
                with critical(store):
                    now = time.time()
                    _, doc = self.read(store)
                    if not self.ours(doc):
                        self.mark_lost(doc, now)
                        return
                    if store.is_local:
                        local_replace(store, self.document(now), self.owner)
                    else:
                        store.write_bytes(LEASE_NAME, self.document(now))
                    self.last_beat = now
            except LockBusy as exc:
                logger.warning("checkpointd: lease heartbeat skipped: %s", exc)
            except RootInUseError as exc:  # a link or other file planted at the lease path
                self.lose(str(exc))
            except Exception as exc:  # noqa: BLE001 - retried at the next beat, never raised into training
                logger.warning("checkpointd: cannot renew the lease on %s (retrying in %.0f s): %r",
                               self.store.display(), self.interval, exc)

    def release(self) -> None:
        """Drop the lease; remove the file if it is still ours. Idempotent; never raises."""
        if self.pid != os.getpid():
            return  # a forked child: the lease is its parent's
        self.stop.set()
        if in_critical_section():  # a finalizer run by gc inside another lease's lock section: no I/O
            self.held = False       # here (and no lock: its heartbeat may wait for that section); the
            with _live_lock:        # file now reads as left over by this process, free to take
                _live.pop(self.owner, None)
            return
        with self.lock:
            was_held = self.held
            self.held = False
            with _live_lock:
                _live.pop(self.owner, None)
            if not was_held:
                return
            try:
                with critical(self.store, remove_lock=True):
                    _, doc = self.read()
                    if self.ours(doc):
                        self.store.remove(LEASE_NAME)
            except Exception as exc:  # noqa: BLE001 - close() and finalizers must not fail on this
                logger.warning("checkpointd: cannot remove the lease %s: %r (it counts as left over once this "
                               "process exits)", self.store.display(LEASE_NAME), exc)


def _heartbeat_loop(state: _LeaseState, stop: threading.Event) -> None:
    while not stop.wait(state.interval):
        state.beat(stop)


def _when(t: Any) -> str:
    if not isinstance(t, (int, float)):
        return "an unknown time"
    return time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(t))


class RootLease:
    """The write lease of one checkpoint root (see the module docstring).

    Args:
        store: the root.
        timeout_secs: a holder on another host whose heartbeat is older than this is taken over;
            heartbeats are written every ``timeout_secs / 4``.
        what: names the holder in other writers' errors ("another CheckpointManager ...").
        settle_secs: object stores (and file systems without flock): how long to wait after writing
            the lease before reading it back to confirm it is ours.

    Dropping the last reference to a ``RootLease`` releases it (``weakref.finalize``, also at
    interpreter exit); the lease refers to no other object than its store, so a manager that holds
    one in an attribute is collected, and its lease released, as usual.
    """

    def __init__(self, store: Store, *, timeout_secs: float = DEFAULT_TIMEOUT_SECS, what: str = "CheckpointManager",
                 settle_secs: float = DEFAULT_SETTLE_SECS) -> None:
        if not isinstance(timeout_secs, (int, float)) or not timeout_secs > 0:
            raise ConfigError(f"lease timeout_secs must be a number > 0, got {timeout_secs!r}")
        if not isinstance(settle_secs, (int, float)) or settle_secs < 0:
            raise ConfigError(f"lease settle_secs must be a number >= 0, got {settle_secs!r}")
        self._args = (store, float(timeout_secs), what, float(settle_secs))
        self._new_state()

    def _new_state(self) -> None:
        self._state = _LeaseState(*self._args)
        self._finalizer = weakref.finalize(self, _LeaseState.release, self._state)

    def _current(self) -> _LeaseState:
        if self._state.pid != os.getpid():  # a forked child starts without a lease of its own
            self._finalizer.detach()
            self._new_state()
        return self._state

    def acquire(self) -> None:
        """Hold the lease (idempotent): create it, or take it over from a holder that is gone.

        Raises:
            RootInUseError: a live writer holds it (the message names it and what to do), or a link
                or non-file is at the lease path.
        """
        self._current().acquire()

    def check(self) -> None:
        """Confirm the lease is still ours (one small read); call it before each commit marker.

        Acquires the lease if it is not held yet.

        Raises:
            RootInUseError: another writer took the lease over (e.g. our heartbeat expired while this
                process was suspended); raised by every later call, until ``acquire()`` succeeds again.
        """
        self._current().check()

    def release(self) -> None:
        """Stop the heartbeat and remove the lease file if it is still ours. Idempotent; never raises."""
        self._current().release()

    @property
    def store(self) -> Store:
        """The root this lease is on."""
        return self._args[0]

    @property
    def held(self) -> bool:
        state = self._state
        return state.held and not state.lost and state.pid == os.getpid()

    @property
    def owner(self) -> str:
        """This lease's owner id (as written in the lease file)."""
        return self._current().owner

    def __repr__(self) -> str:
        return f"RootLease({self._state.store.display()!r}, held={self.held})"
