"""The persist process: staged tensor bytes reach their files from a separate process, bit-exact, and a
process that is gone or fails never loses a checkpoint (its bytes are written in-process instead)."""

from __future__ import annotations

import errno
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import zlib
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

from checkpointd import CheckpointManager, load, options
from checkpointd.storage import persist_process
from checkpointd.storage import sharedmem
from checkpointd.format.manifest import Manifest

pytestmark = pytest.mark.skipif(not sharedmem.supported(), reason="shared staging needs Linux memfd_create")


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 32, 3), torch.nn.Flatten(), torch.nn.Linear(32 * 30 * 30, 64))
    model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 3, 32, 32).to(memory_format=torch.channels_last)).sum().backward()
    opt.step()
    return {"model": model, "optimizer": opt}


def _check_step(root: Path, step: int, state: dict[str, Any]) -> None:
    step_dir = root / f"step-{step:09d}"
    manifest = Manifest.from_json((step_dir / "manifest.json").read_bytes())
    for entry in manifest.files:
        data = (step_dir / entry.path).read_bytes()
        assert len(data) == entry.size
        assert f"crc32:{zlib.crc32(data):08x}" == entry.checksum, entry.path
    weights = torch.load(step_dir / f"Sequential.0.{step}.pt", weights_only=True)
    for k, v in state["model"].state_dict().items():
        assert torch.equal(weights[k], v) and weights[k].stride() == v.stride(), k
    restored = load(root, step=step)
    for k, v in state["optimizer"].state_dict()["state"][0].items():
        assert torch.equal(restored["optimizer"]["state"][0][k], v), k


def test_saves_are_written_by_the_process(tmp_path: Path) -> None:
    state = _state()
    with CheckpointManager(tmp_path, state, compression=None) as mgr:
        mgr.save(1)
        mgr.wait()
        process = persist_process.client()
        assert process is not None and process.alive
        before = process.writes_done
        mgr.save(2)
        mgr.wait()
        assert process.writes_done >= before + 2  # the model file and the optimizer file
    _check_step(tmp_path, 1, state)
    _check_step(tmp_path, 2, state)


def test_a_killed_process_loses_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    state = _state()
    with CheckpointManager(tmp_path, state, compression=None) as mgr:
        mgr.save(1)
        mgr.wait()
        process = persist_process.client()
        assert process is not None
        process.proc.send_signal(signal.SIGKILL)
        process.proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while process.alive and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not process.alive
        with torch.no_grad():
            state["model"][2].weight.add_(1.0)
        mgr.save(2)  # a new process is started for the next arena or file; either way the step lands
        mgr.wait()
    _check_step(tmp_path, 2, state)
    assert "persist process is gone" in caplog.text



def test_a_process_killed_mid_save_loses_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGKILL the persist process while a save's files are being written (large files: recycling and
    blank files made ahead are in play): the bytes it did not confirm are written here, every save
    commits, and the newest restores bit-exact."""
    caplog.set_level("WARNING", logger="checkpointd")
    # a process killed before its first write is taken for one that cannot run here and never started
    # again; only processes that wrote are killed below, and later tests get a working one regardless
    monkeypatch.setattr(persist_process, "_start_failed", False)
    big = {"a": torch.zeros(40 << 18), "b": torch.zeros(24 << 18), "meta": {"s": -1}}

    def assign(step: int) -> None:
        g = torch.Generator().manual_seed(step)
        big["a"].copy_(torch.randn(big["a"].shape, generator=g))
        big["b"].copy_(torch.randn(big["b"].shape, generator=g))
        big["meta"]["s"] = step

    shm = Path("/dev/shm")
    base = Path(tempfile.mkdtemp(dir=shm)) if shm.is_dir() and os.access(shm, os.W_OK) else tmp_path
    kills = 0
    try:
        with CheckpointManager(base / "ckpt", big, compression=None, keep_last=2, max_pending=1) as mgr:
            for step in range(8):
                assign(step)
                mgr.save(step)
                process = persist_process._client
                if step in (1, 4) and process is not None and process.alive and process.writes_done:
                    deadline = time.monotonic() + 10
                    while not process._pending and time.monotonic() < deadline:
                        time.sleep(0.0005)  # until a write request is sent and not yet answered
                    process.proc.send_signal(signal.SIGKILL)
                    kills += 1
                mgr.wait(timeout=60)
            stats = mgr.stats()
            assert stats["saves_committed"] == 8 and stats["saves_failed"] == 0
            assert mgr.steps() == [6, 7]
            for v in big.values():
                if isinstance(v, torch.Tensor):
                    v.zero_()
            assert mgr.restore_latest() == 7
        g = torch.Generator().manual_seed(7)
        assert torch.equal(big["a"], torch.randn(big["a"].shape, generator=g))
        assert torch.equal(big["b"], torch.randn(big["b"].shape, generator=g))
        assert big["meta"] == {"s": 7}
        assert kills >= 1 and "persist process" in caplog.text
        assert "writing those bytes from this process" in caplog.text  # a write it had taken was redone here
    finally:
        persist_process.shutdown()
        if base != tmp_path:
            shutil.rmtree(base, ignore_errors=True)


def test_the_training_process_makes_no_file_writes_of_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Headers and small members go to the process in one request per file, not one ``pwrite`` each
    here (each would drop and retake the GIL a launch-bound training loop is waiting for)."""
    state = _state()
    state["extra"] = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(40)])  # many small members
    calls: list[int] = []
    real_pwrite = os.pwrite

    def counting_pwrite(fd: int, data: Any, offset: int) -> int:
        calls.append(len(memoryview(data)))
        return real_pwrite(fd, data, offset)

    with CheckpointManager(tmp_path, state, compression=None) as mgr:
        mgr.save(1)
        mgr.wait()
        process = persist_process.client()
        assert process is not None and process.alive
        monkeypatch.setattr(os, "pwrite", counting_pwrite)
        mgr.save(2)
        mgr.wait()
        monkeypatch.setattr(os, "pwrite", real_pwrite)
    assert calls == []
    _check_step(tmp_path, 2, state)
    restored = load(tmp_path, step=2)
    for k, v in state["extra"].state_dict().items():
        assert torch.equal(restored["extra"][k], v), k


@pytest.mark.parametrize("refused", ["submit_write", "submit_scatter"])
def test_a_failed_request_is_written_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
                                          refused: str) -> None:
    def refuse(self: Any, *args: Any, **kwargs: Any) -> Future[Any]:
        failed: Future[Any] = Future()
        failed.set_exception(persist_process.PersistProcessError("persist process: refused for the test"))
        return failed

    monkeypatch.setattr(persist_process.PersistProcess, refused, refuse)
    state = _state()
    with CheckpointManager(tmp_path, state, compression=None) as mgr:
        mgr.save(4)
    _check_step(tmp_path, 4, state)
    assert "refused for the test" in caplog.text


def test_write_errors_come_back_with_their_errno(tmp_path: Path) -> None:
    process = persist_process.client()
    assert process is not None
    slab = sharedmem.SharedSlab(1 << 20)
    try:
        path = tmp_path / "readonly.bin"
        path.write_bytes(b"")
        fd = os.open(path, os.O_RDONLY)
        try:
            future = process.submit_write(fd, 1 << 20, "pwrite", 2, [[(0, slab.id, 0, 1 << 20)]], [slab])
            with pytest.raises(OSError) as info:
                future.result(timeout=30)
            assert info.value.errno == errno.EBADF
        finally:
            os.close(fd)
        # a slab the process was never given is an error of the request, not a crash of the process
        other = sharedmem.SharedSlab(4096)
        try:
            fd = os.open(tmp_path / "out.bin", os.O_RDWR | os.O_CREAT)
            try:
                future = process.submit_write(fd, 4096, "pwrite", 1, [[(0, other.id, 0, 4096)]], [])
                with pytest.raises(persist_process.PersistProcessError, match="not mapped"):
                    future.result(timeout=30)
            finally:
                os.close(fd)
        finally:
            other.release()
        assert process.alive
    finally:
        slab.release()


def test_scattered_pieces_land_and_their_errors_come_back(tmp_path: Path) -> None:
    process = persist_process.client()
    assert process is not None
    path = tmp_path / "scatter.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        os.ftruncate(fd, 100)
        assert process.submit_scatter(fd, [(0, b"head"), (50, b"middle"), (96, b"tail")]).result(timeout=30) is None
    finally:
        os.close(fd)
    data = path.read_bytes()
    assert data[:4] == b"head" and data[50:56] == b"middle" and data[96:] == b"tail" and data[4:50] == bytes(46)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(OSError) as info:
            process.submit_scatter(fd, [(0, b"x")]).result(timeout=30)
        assert info.value.errno == errno.EBADF
    finally:
        os.close(fd)
    assert process.alive


@pytest.mark.parametrize("mode", ["pwrite", "mmap"])
def test_a_file_with_another_hard_link_is_never_written(tmp_path: Path, mode: str) -> None:
    """The process writes only regular files with one link: a hard link to someone else's file (planted
    where a checkpoint file should be) is refused with EPERM, by every kind of request, and not changed."""
    process = persist_process.client()
    assert process is not None
    theirs = tmp_path / "theirs.bin"
    theirs.write_bytes(b"precious" * 512)
    os.link(theirs, tmp_path / "planted.bin")
    slab = sharedmem.SharedSlab(4096)
    try:
        fd = os.open(tmp_path / "planted.bin", os.O_RDWR)
        try:
            requests = [
                lambda: process.submit_write(fd, 4096, mode, 1, [[(0, slab.id, 0, 4096)]], [slab]).result(timeout=30),
                lambda: process.submit_scatter(fd, [(0, b"x")]).result(timeout=30),
                lambda: process.attach(fd, 4096, mode, 1),
                lambda: process.keep_blank(fd, 4096),
            ]
            for request in requests:
                with pytest.raises(OSError) as info:
                    request()
                assert info.value.errno == errno.EPERM and "hard links" in str(info.value)
        finally:
            os.close(fd)
    finally:
        slab.release()
    assert theirs.read_bytes() == b"precious" * 512 and theirs.stat().st_nlink == 2
    assert process.alive


def test_a_fifo_is_never_written(tmp_path: Path) -> None:
    process = persist_process.client()
    assert process is not None
    os.mkfifo(tmp_path / "fifo")
    fd = os.open(tmp_path / "fifo", os.O_RDWR | os.O_NONBLOCK)
    try:
        with pytest.raises(OSError) as info:
            process.submit_scatter(fd, [(0, b"x")]).result(timeout=30)
        assert info.value.errno == errno.EPERM and "not a regular file" in str(info.value)
    finally:
        os.close(fd)
    assert process.alive


def test_the_process_writes_what_the_slab_holds(tmp_path: Path) -> None:
    process = persist_process.client()
    assert process is not None
    slab = sharedmem.SharedSlab(3 << 20)
    try:
        payload = os.urandom(3 << 20)
        slab.array[:] = memoryview(payload)
        for mode in ("pwrite", "mmap"):
            path = tmp_path / f"{mode}.bin"
            fd = os.open(path, os.O_RDWR | os.O_CREAT)
            try:
                os.ftruncate(fd, 4 << 20)
                tasks = [[(4096, slab.id, 0, 1 << 20)], [(4096 + (1 << 20), slab.id, 1 << 20, 2 << 20)]]
                crcs = process.submit_write(fd, 4 << 20, mode, 2, tasks, [slab]).result(timeout=30)
            finally:
                os.close(fd)
            data = path.read_bytes()
            assert data[4096:4096 + (3 << 20)] == payload and data[:4096] == bytes(4096)
            assert crcs == [[zlib.crc32(payload[: 1 << 20])], [zlib.crc32(payload[1 << 20:])]]
    finally:
        slab.release()


@pytest.mark.parametrize("mode", ["pwrite", "mmap"])
def test_an_attached_file_takes_puts_until_it_is_detached(tmp_path: Path, mode: str) -> None:
    """A file attached once takes many ``put`` requests at once (a host budget's chunks), each answered
    with its ranges' CRCs; in ``mmap`` mode one mapping serves them all and is kept after ``detach``."""
    process = persist_process.client()
    assert process is not None
    slab = sharedmem.SharedSlab(4 << 20)
    path = tmp_path / f"attached-{mode}.bin"
    try:
        payload = os.urandom(4 << 20)
        slab.array[:] = memoryview(payload)
        fd = os.open(path, os.O_RDWR | os.O_CREAT)
        try:
            os.ftruncate(fd, 5 << 20)
            remote = process.attach(fd, 5 << 20, mode, lanes=2)
            before = process.writes_done
            futures = [remote.submit([[(4096 + i * (1 << 20), slab, i << 20, 1 << 19)],
                                      [(4096 + i * (1 << 20) + (1 << 19), slab, (i << 20) + (1 << 19), 1 << 19)]])
                       for i in (3, 0, 2, 1)]  # out of order, all in flight together
            crcs = [f.result(timeout=30) for f in futures]
            remote.detach()
        finally:
            os.close(fd)
        data = path.read_bytes()
        assert data[4096:4096 + (4 << 20)] == payload and data[:4096] == bytes(4096)
        half = 1 << 19
        for i, got in zip((3, 0, 2, 1), crcs):
            start = i << 20
            assert got == [[zlib.crc32(payload[start:start + half])], [zlib.crc32(payload[start + half:start + 2 * half])]]
        assert process.writes_done >= before + 4
        assert _mappings(process.proc.pid, path) == (1 if mode == "mmap" and process.keeps_mappings else 0)
        with pytest.raises(persist_process.PersistProcessError, match="not attached"):
            remote.submit([[(0, slab, 0, 4096)]]).result(timeout=30)  # detached: its id names nothing now
        assert process.alive
    finally:
        slab.release()


def test_attaching_a_file_that_cannot_be_reserved_is_an_oserror(tmp_path: Path) -> None:
    process = persist_process.client()
    assert process is not None
    path = tmp_path / "readonly.bin"
    path.write_bytes(b"")
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(OSError) as info:
            process.attach(fd, 1 << 20, "mmap", lanes=1)
        assert info.value.errno == errno.EBADF
    finally:
        os.close(fd)
    assert process.alive


def _mapped_bytes(pid: int, name: str) -> int:
    """Bytes of the process ``pid``'s mappings whose path ends with ``name`` (or it deleted) that have
    their pages in (``Rss`` in ``/proc/PID/smaps``)."""
    total, current = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split(None, 5)
            if len(head) >= 5 and "-" in head[0] and ":" not in head[0]:  # a mapping's header line
                path = head[5].rstrip("\n") if len(head) == 6 else ""
                current = path.endswith((name, f"{name} (deleted)"))
            elif current and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


def _wait_until(check: Any, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_making_a_blank_file_waits_while_a_save_writes(tmp_path: Path) -> None:
    """Background populating (a blank file made ahead) yields to saves: while a file is attached it
    maps nothing, and it finishes once the file is detached. (One advice over a whole 3.2 GB blank
    file holds up a save's first file ~0.5 s on an H200 host.)"""
    process = persist_process.client()
    assert process is not None and process.keeps_mappings
    shm = Path("/dev/shm")
    base = Path(tempfile.mkdtemp(dir=shm)) if shm.is_dir() and os.access(shm, os.W_OK) else tmp_path
    saving, blank = base / "saving.bin", base / "blank.bin"
    fds = [os.open(p, os.O_RDWR | os.O_CREAT) for p in (saving, blank)]
    remote = None
    try:
        remote = process.attach(fds[0], 1 << 20, "mmap", lanes=1)
        done: list[Any] = []
        maker = threading.Thread(target=lambda: done.append(process.keep_blank(fds[1], 192 << 20)), daemon=True)
        maker.start()
        assert _wait_until(lambda: _mappings(process.proc.pid, blank) == 1, 10)  # reserved and mapped ...
        time.sleep(0.5)
        assert maker.is_alive() and not done
        assert _mapped_bytes(process.proc.pid, blank.name) == 0  # ... but not populated while the save writes
        remote.detach()
        maker.join(30)
        assert done == [None]
        assert _mapped_bytes(process.proc.pid, blank.name) == 192 << 20  # then made whole
        assert os.fstat(fds[1]).st_size == 192 << 20
    finally:
        if remote is not None:
            remote.detach()  # again, harmless; after a failure, later tests' populating must not wait
        for fd in fds:
            os.close(fd)
        for p in (saving, blank):
            p.unlink(missing_ok=True)
        if base != tmp_path:
            base.rmdir()


def test_making_a_blank_file_waits_for_saves_at_most_the_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A requester that attached a file and never detached it cannot stop the populating for good: it
    waits at most ``BACKGROUND_WAIT_S`` before each range, then populates the range anyway. (The
    server's method, run in this process with the bound shortened.)"""
    from checkpointd.storage import persist_process_main as main

    monkeypatch.setattr(main, "BACKGROUND_RANGE_BYTES", 1 << 20)
    monkeypatch.setattr(main, "BACKGROUND_WAIT_S", 0.2)
    ours, theirs = socket.socketpair()
    server = main.Server(ours, threads=1, slice_bytes=1 << 20, keep=False)
    path = tmp_path / "blank-never-detached.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    entry = worker = None
    try:
        os.ftruncate(fd, 4 << 20)
        entry = main.KeptFile(fd, 4 << 20)
        server._saving = 1  # an attached file whose detach never comes
        started = time.monotonic()
        worker = threading.Thread(target=server.populate_in_background, args=(entry,), daemon=True)
        worker.start()
        worker.join(10)
        took = time.monotonic() - started
        assert not worker.is_alive()  # it ended, though the "save" never did
        assert took >= 4 * 0.2 * 0.9  # ... having waited the bound before each of the four ranges
        assert _mapped_bytes(os.getpid(), path.name) == 4 << 20  # and populated every range
    finally:
        if entry is not None and (worker is None or not worker.is_alive()):
            entry.close()
        os.close(fd)
        server.pool.shutdown()
        ours.close()
        theirs.close()



def test_a_requester_killed_with_answers_unread_ends_the_process_quietly() -> None:
    """A training process SIGKILLed (a preemption) with an answer it had not read resets the connection;
    the process takes that as the end of its requests, as a closed one, instead of dying with a
    traceback in the job's log (seen after kills in ``benchmarks/torture.py --x-mib 24``)."""
    from checkpointd.storage import persist_process_main as main

    ours, theirs = socket.socketpair()
    server = main.Server(ours, threads=1, slice_bytes=1 << 20, keep=False)
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            server.serve()
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            errors.append(exc)

    worker = threading.Thread(target=serve, daemon=True)
    worker.start()
    try:
        main.send_message(theirs, ("exclusive", 7, 0, 0))  # answered: ("ok", 7, False)
        deadline = time.monotonic() + 10
        while not select.select([theirs], [], [], 0)[0] and time.monotonic() < deadline:
            time.sleep(0.01)  # the answer is waiting, unread
        theirs.close()
        worker.join(10)
        assert not worker.is_alive() and errors == []
        assert server.stopping.is_set()
    finally:
        server.pool.shutdown()
        ours.close()
        theirs.close()


def _mappings(pid: int, path: Path) -> int:
    """How many mappings of ``path`` (or of it deleted) the process ``pid`` holds."""
    with open(f"/proc/{pid}/maps") as f:
        return sum(1 for line in f if line.rstrip("\n").endswith((str(path), f"{path} (deleted)")))


def _minor_faults(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def _write_once(process: persist_process.PersistProcess, path: Path, slab: sharedmem.SharedSlab, payload: bytes) -> None:
    slab.array[: len(payload)] = memoryview(payload)
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        os.ftruncate(fd, len(payload))
        crcs = process.submit_write(fd, len(payload), "mmap", 2, [[(0, slab.id, 0, len(payload))]], [slab]).result(timeout=30)
    finally:
        os.close(fd)
    assert crcs == [[zlib.crc32(payload)]] and path.read_bytes() == payload


def test_a_file_written_again_keeps_its_mapping_until_it_is_deleted(tmp_path: Path) -> None:
    """The process keeps its mapping of a file it wrote (the next save into a recycled file finds its
    pages mapped), answers for it when retention asks whether anything else uses it, and lets go of it
    once the file is deleted, so its pages are freed."""
    process = persist_process.client()
    assert process is not None
    slab = sharedmem.SharedSlab(2 << 20)
    path, other = tmp_path / "kept.bin", tmp_path / "other.bin"
    try:
        faults = []
        for _ in range(3):  # saves into one file: one mapping, kept
            before = _minor_faults(process.proc.pid)
            _write_once(process, path, slab, os.urandom(2 << 20))
            faults.append(_minor_faults(process.proc.pid) - before)
            assert _mappings(process.proc.pid, path) == 1
        assert faults[0] >= 256 and faults[2] < 64, faults  # the first write faults the file's 512 pages in; later ones find them
        assert process.exclusive(os.stat(path)) is True  # its own descriptor only
        with open(path, "rb"):
            assert process.exclusive(os.stat(path)) is False  # opened elsewhere: retention must not reuse it
        other.write_bytes(b"x")
        assert process.exclusive(os.stat(other)) is None  # not one of its files: the caller checks itself
        assert process.writes_done >= 2
        before = process.writes_done
        process.exclusive(os.stat(path))
        assert process.writes_done == before  # questions are not writes
        os.unlink(path)
        deadline = time.monotonic() + 10
        while _mappings(process.proc.pid, path) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _mappings(process.proc.pid, path) == 0  # deleted: let go, its pages freed
        _write_once(process, path, slab, os.urandom(1 << 20))  # a new file of that name: written, not the old one's pages
    finally:
        slab.release()


def test_mappings_are_not_kept_when_turned_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(persist_process, "KEEP_MAPPINGS", False)
    persist_process.shutdown()
    slab = sharedmem.SharedSlab(1 << 20)
    try:
        process = persist_process.client()
        assert process is not None
        _write_once(process, tmp_path / "f.bin", slab, os.urandom(1 << 20))
        assert not process.keeps_mappings and _mappings(process.proc.pid, tmp_path / "f.bin") == 0
        assert process.exclusive(os.stat(tmp_path / "f.bin")) is None
    finally:
        slab.release()
        persist_process.shutdown()
        monkeypatch.undo()


def test_mappings_are_kept_by_default_only_where_the_host_runs_one_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0's retention retires every rank's files and can ask only its own process about them."""
    monkeypatch.setattr(persist_process, "KEEP_MAPPINGS", None)
    for name in ("LOCAL_WORLD_SIZE", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert persist_process.keep_mappings()  # one process, no launcher
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert not persist_process.keep_mappings()  # ranks, and nothing says they are on other hosts
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert persist_process.keep_mappings()  # one rank on this host (torchrun)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert not persist_process.keep_mappings()
    monkeypatch.setattr(persist_process, "KEEP_MAPPINGS", True)
    assert persist_process.keep_mappings()  # said so
    monkeypatch.setattr(persist_process, "KEEP_MAPPINGS", False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert not persist_process.keep_mappings()


def _pythonpath() -> str:
    """The package's sources first, then whatever the parent had (installed wheels on the GPU host)."""
    return os.pathsep.join(p for p in (str(Path(__file__).parents[2] / "src"), os.environ.get("PYTHONPATH", "")) if p)


def test_turned_off_nothing_is_shared_and_no_process_starts(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import torch
        from checkpointd import CheckpointManager
        from checkpointd.storage import persist_process
        from checkpointd.storage import sharedmem
        from checkpointd.save.arena import StagingArena
        assert not sharedmem.supported()
        arena = StagingArena([((1000,), (1,), torch.float32)], pin=False)
        assert arena._shared is None
        with CheckpointManager({str(tmp_path)!r}, {{"w": torch.randn(100000)}}, compression=None) as mgr:
            mgr.save(1)
        assert persist_process._client is None
        print("ok")
    """)
    env = {**os.environ, options.PERSIST_PROCESS_ENV: "0", "PYTHONPATH": _pythonpath()}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def test_the_process_exits_with_its_parent(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import os, torch
        from checkpointd import CheckpointManager
        from checkpointd.storage import persist_process
        with CheckpointManager({str(tmp_path)!r}, {{"w": torch.randn(100000)}}, compression=None) as mgr:
            mgr.save(1)
        print(persist_process.client().proc.pid, flush=True)
        os._exit(0)  # no atexit: the closed socket alone must end the process
    """)
    env = {**os.environ, "PYTHONPATH": _pythonpath()}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    pid = int(out.stdout.split()[-1])
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        try:  # our grandchild is reparented; a zombie left for init still answers kill(0) briefly
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split()[2] == "Z":
                    return
        except OSError:
            return
        time.sleep(0.05)
    pytest.fail(f"persist process {pid} outlived its parent")


def test_a_forked_child_does_not_use_the_parents_process() -> None:
    assert persist_process.client() is not None
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os._exit(0 if persist_process._client is None else 3)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert persist_process.client() is not None and persist_process.client().alive


def test_a_process_that_cannot_run_is_not_restarted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A persist process that exits before its first write (a broken install) is not started again and
    again: saves go on with in-process writes."""
    persist_process.shutdown()
    monkeypatch.setattr(persist_process, "_MAIN", str(tmp_path / "missing_main.py"))
    monkeypatch.setattr(persist_process, "_start_failed", False)
    state = _state()
    try:
        with CheckpointManager(tmp_path / "run", state, compression=None) as mgr:
            mgr.save(1)
            mgr.wait()
            first = persist_process._client
            assert first is not None and first.proc.wait(timeout=30) != 0
            deadline = time.monotonic() + 10
            while first.alive and time.monotonic() < deadline:
                time.sleep(0.01)
            mgr.save(2)
            mgr.wait()
            assert persist_process.client() is None and persist_process._start_failed
        _check_step(tmp_path / "run", 1, state)
        _check_step(tmp_path / "run", 2, state)
    finally:
        persist_process._client = None
        monkeypatch.undo()
        assert persist_process.client() is not None  # the real one starts again for later tests


def test_thread_count_comes_from_the_io_threads_and_the_hosts_ranks(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert persist_process.threads_for(32) == 16  # the host's I/O threads shared by its ranks
    assert persist_process.threads_for(6) == 4  # never fewer than 4
    monkeypatch.setenv(options.IO_THREADS_ENV, "12")
    persist_process.shutdown()
    try:
        process = persist_process.client()
        assert process is not None and process.threads == 6
        fd = os.open(tmp_path / "served", os.O_WRONLY | os.O_CREAT)
        try:
            assert process.submit_scatter(fd, [(0, b"x")]).result(timeout=30) is None  # it serves requests
        finally:
            os.close(fd)
        assert (tmp_path / "served").read_bytes() == b"x"
    finally:
        persist_process.shutdown()  # the next test starts one with the default count
