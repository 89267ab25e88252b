"""One writer per root (SPEC §2): ``checkpointd.lease.RootLease`` between real processes on local roots,
between two leases of one process on ``memory://`` (the object-store procedure), and on a real S3
server: a live holder refuses a second writer and is named; a dead or expired holder is taken over; a
reused pid is no holder; release and heartbeats touch only our own lease; links are never followed."""

from __future__ import annotations

import gc
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from checkpointd.errors import RootInUseError
from checkpointd.leasefile import LEASE_NAME, LOCK_NAME, read_lease
from checkpointd.lease import RootLease
from checkpointd.storage.store import Store

SRC = Path(__file__).resolve().parent.parent / "src"

# A writer process: imports checkpointd.lease without the package __init__ (which imports torch), so
# it is ready in a fraction of a second; then answers one JSON command per stdin line. A takeover
# waits ``replace_delay`` seconds before it replaces the lease file, so two racers really overlap.
WORKER = r"""
import json, sys, time, types
pkg = types.ModuleType("checkpointd"); pkg.__path__ = [sys.argv[1] + "/checkpointd"]; pkg.__version__ = "0"
sys.modules["checkpointd"] = pkg
from checkpointd import lease as lease_mod
from checkpointd.lease import RootLease
from checkpointd.storage.store import Store
replace = lease_mod.local_replace
delay = [0.0]
def slow_replace(*args):
    time.sleep(delay[0])
    replace(*args)
lease_mod.local_replace = slow_replace
leases = {}
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    root = cmd["root"]
    delay[0] = cmd.get("replace_delay", 0.0)
    try:
        if cmd["op"] == "acquire":
            leases.setdefault(root, RootLease(Store(root), timeout_secs=cmd.get("timeout", 60.0))).acquire()
        else:
            leases.pop(root).release()
        print(json.dumps({"ok": True}), flush=True)
    except Exception as exc:
        leases.pop(root, None)
        print(json.dumps({"ok": False, "error": type(exc).__name__, "message": str(exc)}), flush=True)
"""


class Worker:
    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER, str(SRC)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.pid = self.proc.pid

    def wait_ready(self) -> None:
        assert json.loads(self.proc.stdout.readline()) == {"ready": True}

    def send(self, op: str, root: Path, **extra: Any) -> None:
        self.proc.stdin.write(json.dumps({"op": op, "root": str(root), **extra}) + "\n")
        self.proc.stdin.flush()

    def reply(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        assert line, f"worker {self.pid} exited with {self.proc.poll()}"
        return json.loads(line)

    def call(self, op: str, root: Path, **extra: Any) -> dict[str, Any]:
        self.send(op, root, **extra)
        return self.reply()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()


@pytest.fixture(scope="module")
def workers() -> Any:
    started = [Worker() for _ in range(3)]
    try:
        for w in started:
            w.wait_ready()
        yield started
    finally:
        for w in started:
            w.stop()


@pytest.fixture
def mem_root() -> str:
    return f"memory://lease-{uuid.uuid4().hex}/root"


def _held_doc() -> dict[str, Any]:
    """A real lease document of this process (released again), for tests to alter."""
    store = Store(f"memory://lease-template-{uuid.uuid4().hex}")
    lease = RootLease(store, settle_secs=0)
    lease.acquire()
    doc = read_lease(store)
    lease.release()
    assert doc is not None
    return doc


def _plant(store: Store, **changes: Any) -> dict[str, Any]:
    """Write a lease of another writer (the template with ``changes``) into ``store``'s root."""
    doc = {**_held_doc(), "owner": uuid.uuid4().hex, **changes}
    data = json.dumps(doc).encode()
    if store.is_local:
        Path(store.root).mkdir(parents=True, exist_ok=True)
        Path(store.path(LEASE_NAME)).write_bytes(data)
    else:
        store.write_bytes(LEASE_NAME, data)
    return doc


def _store(kind: str, tmp_path: Path, mem_root: str) -> Store:
    return Store(tmp_path / "root") if kind == "local" else Store(mem_root)


# -- between processes (local roots) --------------------------------------------------------------
def test_live_holder_in_another_process_refuses_naming_pid_and_host(tmp_path, workers):
    holder = workers[0]
    root = tmp_path / "root"
    assert holder.call("acquire", root) == {"ok": True}
    lease = RootLease(Store(root))
    with pytest.raises(RootInUseError) as err:
        lease.acquire()
    msg = str(err.value)
    assert f"pid {holder.pid} on host {socket.gethostname()}" in msg
    assert "wait for it to finish, stop it, or save to another root" in msg
    assert not lease.held
    assert holder.call("release", root) == {"ok": True}
    lease.acquire()
    assert lease.held and read_lease(Store(root))["owner"] == lease.owner
    lease.release()


def test_sigkilled_holder_is_taken_over_at_once(tmp_path, workers):
    victim = workers[2]
    root = tmp_path / "root"
    assert victim.call("acquire", root) == {"ok": True}
    os.kill(victim.pid, signal.SIGKILL)
    while open(f"/proc/{victim.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
        time.sleep(0.005)  # killed, not yet reaped: a zombie is no holder either
    lease = RootLease(Store(root))
    t0 = time.monotonic()
    lease.acquire()
    assert time.monotonic() - t0 < 1.0
    assert read_lease(Store(root))["owner"] == lease.owner
    lease.release()


def test_two_processes_racing_for_a_dead_holders_lease_one_wins(tmp_path, workers):
    racers = workers[:2]
    for round_ in range(5):
        root = tmp_path / f"root{round_}"
        _plant(Store(root), pid_start=-1)  # this process's pid with another start time: a reused pid
        for w in racers:
            w.send("acquire", root, replace_delay=0.1)
        replies = [w.reply() for w in racers]
        winners = [w for w, r in zip(racers, replies) if r["ok"]]
        assert len(winners) == 1, replies
        loser_reply = next(r for r in replies if not r["ok"])
        assert loser_reply["error"] == "RootInUseError"
        assert f"pid {winners[0].pid} on host" in loser_reply["message"]
        assert read_lease(Store(root))["pid"] == winners[0].pid
        assert winners[0].call("release", root) == {"ok": True}
        assert not (root / LEASE_NAME).exists()


# -- judging a holder -------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["local", "memory"])
def test_other_host_with_fresh_heartbeat_is_refused(kind, tmp_path, mem_root):
    store = _store(kind, tmp_path, mem_root)
    theirs = _plant(store, host="gpu-node-17", pid=4242, heartbeat=time.time() - 20, timeout=60.0)
    lease = RootLease(store, settle_secs=0.01)
    expected = r"pid 4242 on host gpu-node-17.*last heartbeat 2\d\.\d s ago.*older than 60 s"
    with pytest.raises(RootInUseError, match=expected):
        lease.acquire()
    assert read_lease(store)["owner"] == theirs["owner"]


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_other_host_with_expired_heartbeat_is_taken_over(kind, tmp_path, mem_root):
    store = _store(kind, tmp_path, mem_root)
    _plant(store, host="gpu-node-17", pid=4242, heartbeat=time.time() - 61, timeout=60.0)
    lease = RootLease(store, settle_secs=0.01)
    lease.acquire()
    assert lease.held and read_lease(store)["owner"] == lease.owner
    lease.release()


def test_holders_own_timeout_decides_expiry(tmp_path):
    store = Store(tmp_path / "root")
    _plant(store, host="gpu-node-17", heartbeat=time.time() - 61, timeout=600.0)
    with pytest.raises(RootInUseError, match="older than 600 s"):
        RootLease(store, timeout_secs=60.0).acquire()


def test_reused_pid_is_treated_as_dead(tmp_path):
    store = Store(tmp_path / "root")
    doc = _plant(store, pid=os.getppid(), pid_start=12345)  # a live pid, but not the recorded process
    lease = RootLease(store)
    lease.acquire()
    assert read_lease(store)["owner"] == lease.owner != doc["owner"]
    lease.release()


def test_live_pid_with_its_start_time_is_a_holder(tmp_path):
    store = Store(tmp_path / "root")
    parent = os.getppid()
    start = int(open(f"/proc/{parent}/stat").read().rsplit(")", 1)[1].split()[19])
    _plant(store, pid=parent, pid_start=start, heartbeat=time.time() - 3600)  # same host: age is irrelevant
    with pytest.raises(RootInUseError, match=f"pid {parent} on host {socket.gethostname()}"):
        RootLease(store).acquire()


def test_unreadable_lease_file_is_taken_over(tmp_path):
    store = Store(tmp_path / "root")
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / LEASE_NAME).write_bytes(b"")  # what a machine crash can leave
    lease = RootLease(store)
    lease.acquire()
    assert read_lease(store)["owner"] == lease.owner
    lease.release()


# -- one process --------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["local", "memory"])
def test_second_lease_in_this_process_is_refused_until_the_first_is_closed(kind, tmp_path, mem_root):
    first, second = (RootLease(_store(kind, tmp_path, mem_root), settle_secs=0.01) for _ in range(2))
    first.acquire()
    first.acquire()  # idempotent
    with pytest.raises(RootInUseError, match="another CheckpointManager in this process"):
        second.acquire()
    first.release()
    first.release()  # idempotent
    second.acquire()
    assert second.held and not first.held
    second.release()


class _Owner:
    """Stands for a manager: holds its lease in an attribute, and sits in a reference cycle."""

    def __init__(self, store: Store) -> None:
        self.lease = RootLease(store, settle_secs=0.01)
        self.me = self


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_lease_of_an_unreferenced_owner_is_released(kind, tmp_path, mem_root):
    store = _store(kind, tmp_path, mem_root)
    owner = _Owner(store)
    owner.lease.acquire()
    del owner  # still in its cycle: acquire() collects it before refusing
    lease = RootLease(store, settle_secs=0.01)
    lease.acquire()
    assert read_lease(store)["owner"] == lease.owner
    lease.release()
    gc.collect()


def test_leases_on_different_roots_of_one_process(tmp_path):
    a, b = RootLease(Store(tmp_path / "a")), RootLease(Store(tmp_path / "b"))
    a.acquire()
    b.acquire()
    assert a.held and b.held
    a.release()
    b.release()


# -- release, check, heartbeat ------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["local", "memory"])
def test_release_removes_only_our_own_lease(kind, tmp_path, mem_root):
    store = _store(kind, tmp_path, mem_root)
    lease = RootLease(store, settle_secs=0.01)
    lease.acquire()
    theirs = _plant(store, host="gpu-node-17")  # another writer took it over meanwhile
    lease.release()
    assert read_lease(store)["owner"] == theirs["owner"]
    store.remove(LEASE_NAME)
    lease.acquire()
    lease.release()
    assert not store.exists(LEASE_NAME)


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_check_raises_after_another_writer_took_over(kind, tmp_path, mem_root):
    store = _store(kind, tmp_path, mem_root)
    lease = RootLease(store, settle_secs=0.01)
    lease.acquire()
    lease.check()
    _plant(store, host="gpu-node-17", pid=4242)
    with pytest.raises(RootInUseError, match=r"no longer holds the lease.*pid 4242 on host gpu-node-17"):
        lease.check()
    assert not lease.held
    with pytest.raises(RootInUseError):  # sticky until acquire() succeeds again
        lease.check()
    lease.release()
    assert read_lease(store)["host"] == "gpu-node-17"


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_heartbeat_renews_and_notices_a_takeover(kind, tmp_path, mem_root):
    store = _store(kind, tmp_path, mem_root)
    lease = RootLease(store, timeout_secs=0.8, settle_secs=0.01)
    lease.acquire()
    first = read_lease(store)
    deadline = time.monotonic() + 2
    while read_lease(store)["heartbeat"] == first["heartbeat"]:
        assert time.monotonic() < deadline, "no heartbeat within 2 s (interval 0.2 s)"
        time.sleep(0.02)
    renewed = read_lease(store)
    assert (renewed["owner"], renewed["started"], renewed["pid"]) == (first["owner"], first["started"], first["pid"])
    _plant(store, host="gpu-node-17")
    while lease.held:  # the heartbeat thread finds the lease is not ours any more
        assert time.monotonic() < deadline + 1, "heartbeat did not notice the takeover"
        time.sleep(0.02)
    with pytest.raises(RootInUseError, match="host gpu-node-17 holds it now"):
        lease.check()
    assert read_lease(store)["host"] == "gpu-node-17"


def test_heartbeat_io_errors_are_logged_not_raised(mem_root, caplog):
    lease = RootLease(Store(mem_root), timeout_secs=0.4, settle_secs=0.01)
    lease.acquire()
    state = lease._state
    calls = []

    def failing_write(rel: str, data: bytes) -> None:
        calls.append(rel)
        raise PermissionError(13, "denied for the test", rel)

    state.beat_store.write_bytes = failing_write
    deadline = time.monotonic() + 2
    while len(calls) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert lease.held
    lease.check()
    assert "cannot renew the lease" in caplog.text
    lease.release()


# -- links --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [LEASE_NAME, LOCK_NAME])
@pytest.mark.parametrize("target_exists", [True, False])
def test_symlinked_lease_paths_are_refused(name, target_exists, tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    outside = tmp_path / "outside.txt"
    if target_exists:
        outside.write_bytes(b"precious")
    (root / name).symlink_to(outside)
    with pytest.raises(RootInUseError, match="symbolic link"):
        RootLease(Store(root)).acquire()
    assert (root / name).is_symlink()
    assert (outside.read_bytes() == b"precious") if target_exists else not outside.exists()
    assert read_lease(Store(root)) is None


# -- object stores ---------------------------------------------------------------------------------
def test_object_store_race_within_the_settle_time_has_one_winner(mem_root):
    leases = [RootLease(Store(mem_root), settle_secs=0.2) for _ in range(2)]
    for lease in leases:  # both read "no lease" before either write lands, as two hosts can
        store = lease._state.store
        store.write_bytes = lambda rel, data, _write=store.write_bytes: (time.sleep(0.05), _write(rel, data))[1]
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def claim(lease: RootLease) -> None:
        barrier.wait()
        try:
            lease.acquire()
        except RootInUseError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=claim, args=(lease,)) for lease in leases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [lease for lease in leases if lease.held]
    assert len(winners) == 1 and len(errors) == 1
    assert read_lease(Store(mem_root))["owner"] == winners[0].owner
    winners[0].check()
    winners[0].release()


def test_lease_on_s3(s3_root, s3_storage_options):
    first = RootLease(Store(s3_root, s3_storage_options), settle_secs=0.05)
    first.acquire()
    other = Store(s3_root, s3_storage_options)
    assert read_lease(other)["owner"] == first.owner
    with pytest.raises(RootInUseError, match="another CheckpointManager in this process"):
        RootLease(other, settle_secs=0.05).acquire()
    first.check()
    first.release()
    assert not other.exists(LEASE_NAME)
    _plant(other, host="gpu-node-17", pid=4242)
    with pytest.raises(RootInUseError, match="pid 4242 on host gpu-node-17"):
        RootLease(other, settle_secs=0.05).acquire()
