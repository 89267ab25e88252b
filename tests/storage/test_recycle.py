"""Recycling retired checkpoint files (``checkpointd.storage.recycle``): the next save writes over them.

What must hold: the files a save overwrites are ones retention retired, never a file that something
else still has open, mapped or hard-linked; every checkpoint restores bit-exact; the bin never holds
more than one save's worth and is gone after ``close()``; ``options.recycle_enabled()`` turns it off.
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
from tree_compare import big_files

from checkpointd import options
from checkpointd import CheckpointManager, load
from checkpointd.storage import filesahead
from checkpointd.storage import recycle
from checkpointd.storage import recyclebin
from checkpointd.storage import writemode
from checkpointd.storage.store import Store

pytestmark = pytest.mark.skipif(recyclebin.F_SETLEASE is None, reason="needs Linux leases (F_SETLEASE)")

BIN = recyclebin.BIN_NAME


@pytest.fixture(params=["auto", "mmap"])
def write_mode(request, monkeypatch):
    """How the persist process fills files: ``auto`` (positional writes here, on a disk) or ``mmap``
    (as on tmpfs: the process keeps each file's mapping, so retention must ask it whether a retired
    file is in use)."""
    monkeypatch.setattr(writemode, "WRITE_MODE", request.param)
    return request.param


def _persist_mappings(root) -> list[str]:
    """The persist process's mappings of files under ``root`` (deleted ones included)."""
    from checkpointd.storage import persist_process

    process = persist_process._client
    if process is None or not process.alive:
        return []
    with open(f"/proc/{process.proc.pid}/maps") as f:
        return [line.split(None, 5)[5].strip() for line in f if str(root) in line]


def _state(seed: float = 0.0, rows: int = 2048):
    model = torch.nn.Linear(2048, rows, bias=False)  # 2048 rows: 16 MiB of weights, the model file is recycled
    with torch.no_grad():
        model.weight.fill_(seed)
    return model


def _digest(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_saves_write_over_retired_files_and_restore_bit_exact(tmp_path, compression, write_mode, monkeypatch):
    monkeypatch.setattr(filesahead, "FILES_AHEAD_SETS", 0)  # the bin holds retired files only (files made ahead: below)
    model = _state(rows=2560)  # 20 MiB: compressed with zstd still above recyclebin.MIN_RECYCLE_BYTES
    seen_inodes: list[set[int]] = []
    recycled: list[tuple[int, int]] = []
    with CheckpointManager(tmp_path, {"model": model}, every_n_steps=1, keep_last=1,
                           compression=compression) as mgr:
        for step in range(4):
            with torch.no_grad():
                model.weight.normal_()  # random: zstd keeps the file large
            mgr.maybe_save(step)
            mgr.wait()
            files = big_files(tmp_path)
            steps = {k for k in files if k.startswith("step-")}
            seen_inodes.append({files[k].st_ino for k in steps})
            last = mgr.stats()["last_save"]
            recycled.append((last["files_recycled"], len(steps)))
            assert last["files"] >= len(steps)
            binned = [k for k in files if k.startswith(BIN)]
            # after a commit, the retired step's large files wait in the bin (step 0 retired nothing)
            assert len(binned) == (0 if step == 0 else len(steps)), files
            expected = model.weight.detach().clone()
            assert torch.equal(load(tmp_path, step=step)["model"]["weight"], expected)
            if write_mode == "mmap" and compression is None:  # the persist process keeps its mappings
                assert {p for p in _persist_mappings(tmp_path) if "(deleted)" not in p} >= {
                    str(tmp_path / k) for k in steps}
    # step 2 was written over step 0's files, step 3 over step 1's (with mappings kept too)
    assert seen_inodes[2] == seen_inodes[0] and seen_inodes[3] == seen_inodes[1]
    assert [r for r, _ in recycled] == [0, 0, recycled[2][1], recycled[3][1]] and recycled[2][1] >= 1  # stats() says so
    assert sorted(os.listdir(tmp_path)) == ["step-000000003"]  # close() emptied and removed the bin
    deadline = time.monotonic() + 10
    while any("(deleted)" in p for p in _persist_mappings(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in _persist_mappings(tmp_path) if "(deleted)" in p]  # the bin's pages are freed
    fresh = _state(1.0, rows=2560)
    with CheckpointManager(tmp_path, {"model": fresh}) as mgr:
        assert mgr.restore_latest() == 3
    assert torch.equal(fresh.weight, model.weight)


def _wait_for_files_ahead(mgr, count: int) -> list[int]:
    deadline = time.monotonic() + 30
    while len(mgr._files_ahead.made) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    return list(mgr._files_ahead.made)


def test_the_first_saves_write_into_files_made_ahead(tmp_path, write_mode):
    """Blank files for the first two saves are made with the staging buffers (reserved, and on memory
    file systems mapped by the persist process); the saves write into them and restore bit-exact."""
    model = _state()
    inodes: list[set[int]] = []
    with CheckpointManager(tmp_path, {"model": model}, every_n_steps=1, keep_last=1, compression=None) as mgr:
        assert mgr.restore_latest() is None  # nothing yet; the staging buffers (and files) are prepared now
        made = _wait_for_files_ahead(mgr, 2)
        assert len(made) == 2 and all(n >= model.weight.nbytes for n in made)  # one file a save, two saves
        blank = {st.st_ino: st.st_size for k, st in big_files(tmp_path).items() if k.startswith(BIN)}
        assert len(blank) == 2 and all(os.stat(os.path.join(tmp_path, BIN, n)).st_blocks * 512 >= made[0]
                                       for n in os.listdir(tmp_path / BIN))  # reserved, not sparse
        if write_mode == "mmap":  # the persist process keeps them mapped, ahead of the first write
            assert sum(1 for p in _persist_mappings(tmp_path) if BIN in p) == 2
        for step in range(3):
            with torch.no_grad():
                model.weight.normal_()
            mgr.maybe_save(step)
            mgr.wait()
            files = big_files(tmp_path)
            inodes.append({files[k].st_ino for k in files if k.startswith(f"step-{step:09d}")})
            assert torch.equal(load(tmp_path, step=step)["model"]["weight"], model.weight)
            assert os.path.getsize(_step_file(tmp_path, step)) < max(made)  # the exact size was set
            assert mgr.stats()["last_save"]["files_recycled"] == 1  # a blank file (saves 0, 1), a retired one (2)
    assert inodes[0] | inodes[1] == set(blank)  # saves 0 and 1 took the blank files
    assert inodes[2] == inodes[0]  # save 2 took step 0's, retired
    assert sorted(os.listdir(tmp_path)) == ["step-000000002"]


def test_no_files_are_made_ahead_where_a_save_would_not_take_them(tmp_path, monkeypatch):
    for root, kwargs, sets, env in [(tmp_path / "zstd", {"compression": "zstd"}, 2, {}),
                                    (tmp_path / "off", {"compression": None}, 0, {}),
                                    (tmp_path / "norecycle", {"compression": None}, 2, {options.RECYCLE_ENV: "0"})]:
        monkeypatch.setattr(filesahead, "FILES_AHEAD_SETS", sets)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        with CheckpointManager(root, {"model": _state()}, **kwargs) as mgr:
            mgr.restore_latest()
            assert mgr._files_ahead is False
            assert not (root / BIN).exists()
        for k in env:
            monkeypatch.delenv(k)


def test_files_ahead_stop_at_a_failure_and_leave_nothing_half_made(tmp_path, monkeypatch):
    store = Store(str(tmp_path))
    calls = []

    def full(fd, offset, length):
        calls.append(length)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        os.ftruncate(fd, length)

    monkeypatch.setattr(filesahead.os, "posix_fallocate", full)
    ahead = filesahead.FilesAhead(store, [64 << 20, 32 << 20], sets=2)
    ahead.start()
    ahead.wait(30)
    assert ahead.made == [64 << 20] and len(calls) == 2
    assert [n.endswith(".bin") for n in os.listdir(tmp_path / BIN)] == [True]  # the failed one is gone
    again = filesahead.FilesAhead(store, [64 << 20], sets=1)  # the bin holds a file: a new run makes none
    again.start()
    again.wait(30)
    assert again.made == []


_MAKE_AHEAD_AND_WAIT = """
import sys
from checkpointd.storage import filesahead
from checkpointd.storage.store import Store
ahead = filesahead.FilesAhead(Store(sys.argv[1]), [int(sys.argv[2])], sets=1)
ahead.start()
ahead.wait(60)
print(len(ahead.made), flush=True)
sys.stdin.read()  # alive until the parent closes our stdin
"""


def test_each_rank_of_a_host_makes_its_own_files_ahead(tmp_path):
    """Ranks of one host share the bin: blank files another running process (a rank) made are not a
    previous run's, so this process makes its own set too; once that process is gone, its files are
    leftovers and a new run makes none (its saves take them), nor does a second manager of this process."""
    nbytes = 20 << 20
    other = subprocess.Popen([sys.executable, "-c", _MAKE_AHEAD_AND_WAIT, str(tmp_path), str(nbytes)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "1"  # the other rank made its file and runs on
        mine = filesahead.FilesAhead(Store(str(tmp_path)), [nbytes], sets=1)
        mine.start()
        mine.wait(30)
        assert mine.made == [nbytes]
        assert len([n for n in os.listdir(tmp_path / BIN) if n.endswith(".bin")]) == 2
    finally:
        other.stdin.close()
        other.wait(30)
    # A new process now: this one's file is another running process's, the gone one's a leftover.
    later = subprocess.run([sys.executable, "-c", _MAKE_AHEAD_AND_WAIT, str(tmp_path), str(nbytes)],
                           input="", capture_output=True, text=True, timeout=60)
    assert later.stdout.strip() == "0", later.stderr
    assert len(os.listdir(tmp_path / BIN)) == 2
    again = filesahead.FilesAhead(Store(str(tmp_path)), [nbytes], sets=1)  # this process's own file: a leftover
    again.start()
    again.wait(30)
    assert again.made == []


@pytest.mark.parametrize("fstype", ["tmpfs", "ext4"])
def test_blank_files_on_a_memory_file_system_are_written_with_zeros(tmp_path, monkeypatch, fstype):
    """Reserved is not enough on tmpfs: the pages are cleared at their first write (the first save's),
    so where no persist process faults them in, this thread writes zeros over the file; on a disk it
    does not (the zeros would be written to the disk too). Stopped midway, no file is left."""
    from checkpointd.storage import fsinfo

    monkeypatch.setattr(fsinfo, "fd_filesystem_type", lambda fd: fstype)
    writes: list[int] = []
    real_pwrite = os.pwrite

    def pwrite(fd, data, offset):
        writes.append(len(data))
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(filesahead.os, "pwrite", pwrite)
    nbytes = 20 << 20
    ahead = filesahead.FilesAhead(Store(str(tmp_path / "a")), [nbytes], sets=1)
    ahead.start()
    ahead.wait(30)
    assert ahead.made == [nbytes]
    assert sum(writes) == (nbytes if fstype == "tmpfs" else 0)
    [name] = os.listdir(tmp_path / "a" / BIN)
    assert os.path.getsize(tmp_path / "a" / BIN / name) == nbytes
    if fstype == "tmpfs":
        assert max(writes) == filesahead.ZERO_WRITE_BYTES
        busy = threading.Event()
        stopper = filesahead.FilesAhead(Store(str(tmp_path / "b")), [nbytes], sets=1, busy=busy.is_set)

        def pwrite_then_busy(fd, data, offset):
            busy.set()  # the staging buffers are being prepared: the zeros wait, then stop() ends them
            return real_pwrite(fd, data, offset)

        monkeypatch.setattr(filesahead.os, "pwrite", pwrite_then_busy)
        stopper.start()
        deadline = time.monotonic() + 30
        while not busy.is_set() and time.monotonic() < deadline:
            time.sleep(0.01)
        stopper.stop()
        assert stopper.made == [] and os.listdir(tmp_path / "b" / BIN) == []


def test_files_ahead_wait_while_the_staging_buffers_are_prepared(tmp_path):
    """No blank file is begun while ``busy()`` (the staging buffers being page-locked); stopped while
    waiting, none is made at all."""
    busy = threading.Event()
    busy.set()
    ahead = filesahead.FilesAhead(Store(str(tmp_path / "a")), [32 << 20], sets=2, busy=busy.is_set)
    ahead.start()
    time.sleep(0.4)
    assert ahead.made == [] and not (tmp_path / "a" / BIN).exists()
    busy.clear()
    ahead.wait(30)
    assert ahead.made == [32 << 20, 32 << 20]
    busy.set()
    stopped = filesahead.FilesAhead(Store(str(tmp_path / "b")), [32 << 20], sets=1, busy=busy.is_set)
    stopped.start()
    t0 = time.monotonic()
    stopped.stop()
    assert time.monotonic() - t0 < 5 and stopped.made == [] and not (tmp_path / "b" / BIN).exists()


def test_the_manager_makes_files_ahead_once_its_staging_buffers_are_ready(tmp_path, monkeypatch):
    from checkpointd.save import snapshot

    gate = threading.Event()
    prepare = snapshot.Snapshotter._prepare

    def slow_prepare(self, *args, **kwargs):
        gate.wait(30)  # an arena still being page-locked
        return prepare(self, *args, **kwargs)

    monkeypatch.setattr(snapshot.Snapshotter, "_prepare", slow_prepare)
    model = _state()
    with CheckpointManager(tmp_path, {"model": model}, every_n_steps=1, keep_last=1, compression=None) as mgr:
        mgr.restore_latest()  # the staging buffers (and the files ahead) are started now
        time.sleep(0.4)
        assert mgr._snap.preparing() and mgr._files_ahead.made == []
        gate.set()
        assert len(_wait_for_files_ahead(mgr, 2)) == 2
        assert not mgr._snap.preparing()


def test_files_ahead_wait_while_a_save_writes(tmp_path, monkeypatch):
    """Blank files are not made while a save writes (both would share the same memory): none is made
    while the first save is held in its write; once it is done, the second save's set is made, not the
    first's (that save began without it)."""
    from checkpointd.save import writer as writer_mod

    gate, entered = threading.Event(), threading.Event()
    real = writer_mod.BackgroundWriter.write_files

    def held(self, job):
        entered.set()
        gate.wait(30)
        return real(self, job)

    monkeypatch.setattr(writer_mod.BackgroundWriter, "write_files", held)
    with CheckpointManager(tmp_path, {"model": _state()}, every_n_steps=1, keep_last=1, compression=None) as mgr:
        preparing = threading.Event()  # held "preparing" until the save writes: no file is made before it
        preparing.set()
        monkeypatch.setattr(mgr._snap, "preparing", preparing.is_set)  # read only by the files-ahead wait
        mgr.maybe_save(0)
        try:
            assert entered.wait(30)
            preparing.clear()  # from now on only the save's writing holds the files back
            assert mgr._files_ahead_wait()
            time.sleep(0.5)
            assert mgr._files_ahead.made == []
        finally:
            gate.set()
        mgr.wait()
        assert len(_wait_for_files_ahead(mgr, 1)) == 1
        time.sleep(0.3)
        assert len(mgr._files_ahead.made) == 1 and not mgr._files_ahead_wait()
        mgr.maybe_save(1)  # the second save takes it
        mgr.wait()
        assert mgr.stats()["last_save"]["files_recycled"] == 1


def test_files_ahead_are_made_only_for_saves_not_yet_begun(tmp_path, monkeypatch):
    """Set k is for save k + 1: with one save begun, one set of two is made; a file being written with
    zeros when the save it was for begins is given up and removed at once, not finished and left for
    the next retirement to delete on a save's time (0.43 s of a 0.86 s save on an H200 host)."""
    from checkpointd.storage import fsinfo

    monkeypatch.setattr(fsinfo, "fd_filesystem_type", lambda fd: "tmpfs")  # zeros are written
    started = [1]
    nbytes = 24 << 20
    ahead = filesahead.FilesAhead(Store(str(tmp_path / "a")), [nbytes], sets=2, saves_started=lambda: started[0])
    ahead.start()
    ahead.wait(30)
    assert ahead.made == [nbytes] and ahead.given_up == 0  # the second save's file only
    [name] = os.listdir(tmp_path / "a" / BIN)
    started[0] = 2
    os.rename(tmp_path / "a" / BIN / name, tmp_path / "a" / "taken")  # the second save begins and takes it
    ahead.want([nbytes])  # a later layout change: nothing is wanted any more
    ahead.wait(30)
    assert ahead.made == [nbytes] and os.listdir(tmp_path / "a" / BIN) == []

    real_pwrite = os.pwrite
    writes: list[int] = []

    def pwrite(fd, data, offset):
        writes.append(len(data))
        if len(writes) == 2:
            started[0] = 2  # the second save begins while its file is half written
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(filesahead.os, "pwrite", pwrite)
    started[0] = 1
    late = filesahead.FilesAhead(Store(str(tmp_path / "b")), [nbytes], sets=2, saves_started=lambda: started[0])
    late.start()
    late.wait(30)
    assert late.made == [] and late.given_up == 1
    assert len(writes) == 2 < nbytes // filesahead.ZERO_WRITE_BYTES  # given up midway, not finished
    assert os.listdir(tmp_path / "b" / BIN) == []  # and removed
    none_left = filesahead.FilesAhead(Store(str(tmp_path / "c")), [nbytes], sets=2, saves_started=lambda: 2)
    none_left.start()
    none_left.wait(30)
    assert none_left.made == [] and not (tmp_path / "c" / BIN).exists()


def test_files_ahead_follow_the_optimizer_state_that_appears_after_the_first_preparation(tmp_path):
    """A run that calls ``restore_latest()`` before its first step prepares the staging buffers (and
    the blank files) before the optimizer has state; once it has, the optimizer's file (the largest)
    gets its blank files too, and the first save writes both files into blank ones."""
    model = torch.nn.Linear(2048, 2048, bias=False)
    opt = torch.optim.Adam(model.parameters())
    with CheckpointManager(tmp_path, {"model": model, "optim": opt}, every_n_steps=100, keep_last=1,
                           compression=None) as mgr:
        assert mgr.restore_latest() is None
        model_size = model.weight.nbytes
        assert len(_wait_for_files_ahead(mgr, 2)) == 2 and all(n < 2 * model_size for n in mgr._files_ahead.made)
        model(torch.randn(2, 2048)).sum().backward()
        opt.step()  # the optimizer's state (2x the weights) appears; its hook prepares buffers again
        made = _wait_for_files_ahead(mgr, 4)
        assert sorted(made) == sorted(mgr._files_ahead.made) and len(made) == 4
        assert sum(n >= 2 * model_size for n in made) == 2  # two saves' worth for the optimizer's file
        blank = {st.st_ino for k, st in big_files(tmp_path).items() if k.startswith(BIN)}
        mgr.maybe_save(0, force=True)
        mgr.wait()
        saved = {k: st for k, st in big_files(tmp_path).items() if k.startswith("step-")}
        assert len(saved) == 2 and {st.st_ino for st in saved.values()} <= blank  # both files were blank ones
    fresh = torch.nn.Linear(2048, 2048, bias=False)
    fresh_opt = torch.optim.Adam(fresh.parameters())
    with CheckpointManager(tmp_path, {"model": fresh, "optim": fresh_opt}) as mgr:
        assert mgr.restore_latest() == 0
    assert torch.equal(fresh.weight, model.weight)
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg_sq"], opt.state_dict()["state"][0]["exp_avg_sq"])


def test_files_ahead_make_what_a_new_layout_is_missing(tmp_path):
    mb = 1 << 20
    ahead = filesahead.FilesAhead(Store(str(tmp_path)), [20 * mb], sets=2)
    ahead.start()
    ahead.wait(30)
    assert ahead.made == [20 * mb, 20 * mb]
    ahead.want([20 * mb, 50 * mb, 30 * mb])  # one save's files now: the first save's set first
    ahead.wait(30)
    assert ahead.made == [20 * mb, 20 * mb, 50 * mb, 30 * mb, 50 * mb, 30 * mb]
    assert ahead.sizes == [50 * mb, 30 * mb, 20 * mb]


def test_a_file_much_larger_than_needed_is_left_for_a_larger_one(tmp_path):
    """``take`` leaves a file more than 1.5x the size asked for (the model's file took the optimizer's
    blank file, twice its size, and the optimizer's found none); a smaller one is taken and grown."""
    bin_ = tmp_path / BIN
    bin_.mkdir()
    mb = 1 << 20
    with open(bin_ / "big.bin", "wb") as f:
        f.truncate(100 * mb)
    assert not recyclebin.take(str(bin_), str(tmp_path / "small.pt"), 40 * mb)
    assert recyclebin.take(str(bin_), str(tmp_path / "fits.pt"), 70 * mb)
    assert os.path.getsize(tmp_path / "fits.pt") == 100 * mb
    with open(bin_ / "smaller.bin", "wb") as f:
        f.truncate(20 * mb)
    assert recyclebin.take(str(bin_), str(tmp_path / "larger.pt"), 90 * mb)  # e.g. compressed: asked for its raw size


def _step_file(root, step: int) -> str:
    (name,) = [k for k in big_files(root) if k.startswith(f"step-{step:09d}/")]
    return os.path.join(root, name)


@pytest.mark.parametrize("holder", ["fd_here", "mapping", "other_process", "hard_link"])
def test_a_retired_file_in_use_is_deleted_not_overwritten(tmp_path, holder, write_mode):
    model = _state()
    keep = []
    with CheckpointManager(tmp_path, {"model": model}, every_n_steps=1, keep_last=1, compression=None) as mgr:
        mgr.maybe_save(0)
        mgr.wait()
        path = _step_file(tmp_path, 0)
        before = _digest(path)
        if holder == "fd_here":
            keep.append(open(path, "rb"))
        elif holder == "mapping":
            with open(path, "rb") as f:
                keep.append(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))  # the descriptor is closed
        elif holder == "other_process":
            proc = subprocess.Popen([sys.executable, "-c", "import sys; f = open(sys.argv[1], 'rb'); "
                                     "print('open', flush=True); sys.stdin.read()", path],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            assert proc.stdout.readline().strip() == "open"
        else:
            os.link(path, tmp_path.parent / f"{tmp_path.name}-link.pt")
        try:
            for step in (1, 2, 3):
                with torch.no_grad():
                    model.weight.add_(1.0)
                mgr.maybe_save(step)
                mgr.wait()
            if holder == "fd_here":
                keep[0].seek(0)
                assert hashlib.sha256(keep[0].read()).hexdigest() == before
            elif holder == "mapping":
                assert hashlib.sha256(keep[0][:]).hexdigest() == before
            elif holder == "other_process":
                out = subprocess.run([sys.executable, "-c", "import hashlib, os, sys; "
                                      "print(hashlib.sha256(open(f'/proc/{sys.argv[1]}/fd/3', 'rb').read()).hexdigest())",
                                      str(proc.pid)], capture_output=True, text=True, check=True)
                assert out.stdout.strip() == before
            else:
                assert _digest(tmp_path.parent / f"{tmp_path.name}-link.pt") == before
        finally:
            for k in keep:
                k.close()
            if holder == "other_process":
                proc.stdin.close()
                proc.wait(timeout=30)
    assert torch.equal(load(tmp_path, step=3)["model"]["weight"], model.weight)


def test_disabled_by_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(options.RECYCLE_ENV, "0")
    model = _state()
    with CheckpointManager(tmp_path, {"model": model}, every_n_steps=1, keep_last=1, compression=None) as mgr:
        for step in range(3):
            mgr.maybe_save(step)
            mgr.wait()
            assert BIN not in os.listdir(tmp_path)


def _bin_file(directory, name: str, nbytes: int) -> str:
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, name)
    with open(path, "wb") as f:
        f.truncate(nbytes)
    return path


def test_take_prefers_the_smallest_file_that_fits(tmp_path):
    mib = 1 << 20
    d = tmp_path / BIN
    _bin_file(d, "a.bin", 20 * mib)
    _bin_file(d, "b.bin", 40 * mib)
    _bin_file(d, "d.checking", 50 * mib)  # still being checked: never taken
    _bin_file(d, "c.bin", 30 * mib)
    assert recyclebin.take(str(d), str(tmp_path / "x"), 25 * mib)
    assert os.path.getsize(tmp_path / "x") == 30 * mib
    assert recyclebin.take(str(d), str(tmp_path / "y"), 50 * mib)  # none fits: the largest left
    assert os.path.getsize(tmp_path / "y") == 40 * mib
    assert not recyclebin.take(str(d), str(tmp_path / "z"), 1024)  # small files are never recycled
    assert recyclebin.take(str(d), str(tmp_path / "z"), 20 * mib)
    assert not recyclebin.take(str(d), str(tmp_path / "w"), 20 * mib)  # only the file being checked is left
    assert not recyclebin.take(str(tmp_path / "no-bin"), str(tmp_path / "w"), 20 * mib)


def test_retirement_keeps_at_most_what_the_next_save_needs(tmp_path):
    mib = 1 << 20
    store = Store(str(tmp_path))
    stale = _bin_file(tmp_path / BIN, "stale", 20 * mib)  # left by an earlier pass: deleted first
    for step, sizes in {1: [20, 30], 2: [20, 30], 3: [20, 30]}.items():
        for k, size in enumerate(sizes):
            _bin_file(tmp_path / f"step-{step:09d}", f"f{k}", size * mib)
    small = _bin_file(tmp_path / "step-000000001", "small", 1024)
    retirement = recycle.Retirement(store, "step-000000003")  # the next save writes 50 MiB
    retirement.retire("step-000000001")
    retirement.retire("step-000000002")
    assert not os.path.exists(stale)
    assert os.path.exists(small)  # small files stay for the caller to delete with the directory
    assert sorted(n for _, n in recyclebin.bin_entries(str(tmp_path / BIN))) == [20 * mib, 30 * mib]
    assert retirement.recycled_bytes == 50 * mib
    assert sorted(os.listdir(tmp_path / "step-000000002")) == ["f0", "f1"]  # over budget: left to be deleted
    recyclebin.empty(store)
    assert not (tmp_path / BIN).exists()


def test_a_retired_file_a_little_larger_than_the_next_saves_is_recycled(tmp_path):
    """Compressed files of two saves differ by a little: the older one, slightly larger, is kept."""
    mib = 1 << 20
    store = Store(str(tmp_path))
    _bin_file(tmp_path / "step-000000001", "f.pt.zst", 20 * mib + 20 * 1024)
    _bin_file(tmp_path / "step-000000002", "f.pt.zst", 20 * mib)
    retirement = recycle.Retirement(store, "step-000000002")
    retirement.retire("step-000000001")
    assert [n for _, n in recyclebin.bin_entries(str(tmp_path / BIN))] == [20 * mib + 20 * 1024]


def test_streamed_files_take_a_retired_file_only_when_large(tmp_path):
    mib = 1 << 20
    store = Store(str(tmp_path))
    _bin_file(tmp_path / BIN, "a.bin", 40 * mib)
    with store.open_write("step-000000001/small.pt", expected_bytes=1024) as f:
        f.write(b"x" * 1024)
        assert not f.recycled
    assert os.path.exists(tmp_path / BIN / "a.bin")  # a small file never takes one
    with store.open_write("step-000000001/big.pt.zst", expected_bytes=30 * mib) as f:
        f.write(b"y" * (3 * mib))  # compressed: fewer bytes than the retired file held
        assert f.recycled  # what stats()["last_save"]["files_recycled"] counts
    assert not os.path.exists(tmp_path / BIN / "a.bin")
    with open(tmp_path / "step-000000001" / "big.pt.zst", "rb") as f:
        assert f.read() == b"y" * (3 * mib)  # cut to what was written
