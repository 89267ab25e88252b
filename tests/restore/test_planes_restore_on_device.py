"""A restore of ``zstd-planes`` files decoded on the device: the host copy of their float tensors is written
only when something reads it on the host (``device_image.ensure_host``), never read unwritten.

On the CPU the "device" is the CPU (as in ``test_device_verify.py``), and the host bytes that the device
decoder leaves unwritten are poisoned, so that any read of them before ``ensure_host`` shows in the restored
values. The CUDA run: ``tests/gpu/test_planes_on_device_cuda.py``.
"""

from __future__ import annotations

import os
import signal
import struct
import threading
import time
import zlib

import pytest
import torch
from torch import nn

from checkpointd import CheckpointManager
from checkpointd.codecs import compress, huffman, planes_device
from checkpointd.codecs.container import PLANES_FOOTER_MAGIC, ViewFile, read_index
from checkpointd.errors import CorruptCheckpointError
from checkpointd.restore import apply, bulkcopy, device_decode, device_image, fastload
from checkpointd.restore import step as restore
from checkpointd.testing import tamper

CPU = torch.device("cpu")
POISON = 0xA5


@pytest.fixture
def on_cpu_device(monkeypatch):
    """Restores verify and decode on the CPU "device"; the unwritten host bytes are poisoned."""
    monkeypatch.setattr(fastload, "use_mmap", lambda path, size: size > 0)
    monkeypatch.setenv("CHECKPOINTD_RESTORE_VERIFY", "device")
    monkeypatch.setattr(device_image, "MIN_BYTES", 1)
    monkeypatch.setattr(device_image, "target_device", lambda objs: CPU)
    real = device_decode.decode_on_device

    def poisoned(*args, **kwargs):
        out = real(*args, **kwargs)
        for lo, hi in out.device_only:
            out.host[lo:hi] = POISON
        return out

    monkeypatch.setattr(device_decode, "decode_on_device", poisoned)


@pytest.fixture
def bulk_on_cpu(monkeypatch):
    """CPU -> CPU copies take the bulk path, so that they come from the images as CUDA copies do."""
    monkeypatch.setattr(apply, "PLACE_ON_CPU", True)
    plain = bulkcopy.raw_copyable

    def raw_copyable(dst, src):
        return plain(dst, src) or (
            dst.device.type == src.device.type == "cpu" and dst.dtype == src.dtype and dst.shape == src.shape
            and dst.stride() == src.stride() and type(dst) in (torch.Tensor, nn.Parameter)
            and type(src) in (torch.Tensor, nn.Parameter) and bulkcopy.is_dense(dst) and bulkcopy.is_dense(src)
            and dst.numel() > 0)

    def device_to_device(device, items):
        for dst, src in items:
            dst.copy_(src)

    monkeypatch.setattr(bulkcopy, "raw_copyable", raw_copyable)
    monkeypatch.setattr(bulkcopy, "device_to_device", device_to_device)


def _trained(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(256, 384), nn.Linear(384, 200))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        model(torch.randn(4, 256)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _saved(tmp_path, objects):
    with CheckpointManager(str(tmp_path), objects, compression="zstd-planes") as mgr:
        mgr.save(1)
        mgr.wait()
    return {k: _snapshot(v) for k, v in objects.items()}


def _snapshot(obj):
    if isinstance(obj, torch.optim.Optimizer):
        return [{k: v.clone() for k, v in obj.state[p].items()} for g in obj.param_groups for p in g["params"]]
    return {k: v.clone() for k, v in obj.state_dict().items()}


def _scramble(objects) -> None:
    with torch.no_grad():
        for obj in objects.values():
            if isinstance(obj, torch.optim.Optimizer):
                for st in obj.state.values():
                    for v in st.values():
                        v.fill_(7)
            else:
                for t in obj.state_dict().values():
                    t.fill_(3)


def _assert_equal(expected, objects) -> None:
    for name, obj in objects.items():
        got, want = _snapshot(obj), expected[name]
        if isinstance(got, dict):
            assert got.keys() == want.keys()
            got, want = list(got.values()), list(want.values())
        for a, b in zip(got, want):
            if isinstance(a, dict):
                assert a.keys() == b.keys()
                assert all(torch.equal(a[k], b[k]) for k in a), name
            else:
                assert torch.equal(a, b), name


def _restore(tmp_path, objects) -> dict[str, int]:
    before = dict(device_image.stats)
    with CheckpointManager(str(tmp_path), objects, compression="zstd-planes") as mgr:
        assert mgr.restore_latest() == 1
    return {k: device_image.stats[k] - before[k] for k in before}


def test_copies_from_the_device_never_read_the_unwritten_host_bytes(tmp_path, on_cpu_device, bulk_on_cpu) -> None:
    model, opt = _trained()
    objects = {"model": model, "optim": opt}
    expected = _saved(tmp_path, objects)
    _scramble(objects)
    got = _restore(tmp_path, objects)
    assert got["decoded"] >= 2 and got["failed"] == 0
    assert got["copies"] >= 8  # weights, biases, both moments: from the decoded images
    assert got["host_filled_bytes"] == 0
    _assert_equal(expected, objects)


def test_host_copies_write_the_host_bytes_they_read_first(tmp_path, on_cpu_device) -> None:
    model, opt = _trained()
    objects = {"model": model, "optim": opt}
    expected = _saved(tmp_path, objects)
    _scramble(objects)
    got = _restore(tmp_path, objects)  # CPU destinations: plain copies from the host bytes
    _assert_equal(expected, objects)
    assert got["decoded"] >= 2 and got["copies"] == 0
    assert got["host_filled_bytes"] > 4 * 256 * 384  # at least the first weight and its moments


class _OwnLoader(nn.Linear):
    """A module whose ``load_state_dict`` is its own: restored by the per-entry path, from host values."""

    def load_state_dict(self, state_dict, strict=True, assign=False):
        with torch.no_grad():
            self.weight.copy_(state_dict["weight"])
            self.bias.copy_(state_dict["bias"])
        return None


def test_the_per_entry_path_reads_written_host_bytes(tmp_path, on_cpu_device, bulk_on_cpu) -> None:
    torch.manual_seed(3)
    objects = {"own": _OwnLoader(300, 200), "plain": nn.Linear(300, 200)}
    expected = _saved(tmp_path, objects)
    _scramble(objects)
    got = _restore(tmp_path, objects)
    _assert_equal(expected, objects)
    assert got["decoded"] >= 1 and got["host_filled_bytes"] >= 300 * 200 * 4


def test_an_apply_out_of_memory_runs_again_from_written_host_bytes(tmp_path, on_cpu_device, bulk_on_cpu,
                                                                  monkeypatch) -> None:
    model, opt = _trained(1)
    objects = {"model": model, "optim": opt}
    expected = _saved(tmp_path, objects)
    _scramble(objects)
    real, calls = restore.apply_entries, []

    def once_out_of_memory(entries, values):
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        real(entries, values)

    monkeypatch.setattr(restore, "apply_entries", once_out_of_memory)
    got = _restore(tmp_path, objects)
    _assert_equal(expected, objects)
    assert len(calls) == 2 and got["host_filled_bytes"] > 0 and got["copies"] == 0


def test_a_device_failure_decodes_on_the_host(tmp_path, on_cpu_device, monkeypatch) -> None:
    model, opt = _trained(2)
    objects = {"model": model, "optim": opt}
    expected = _saved(tmp_path, objects)
    _scramble(objects)

    def broken(*args, **kwargs):
        raise RuntimeError("device decode failed (test)")

    monkeypatch.setattr(device_decode, "decode_on_device", broken)
    got = _restore(tmp_path, objects)
    assert got["decoded"] == 0 and got["failed"] >= 1
    _assert_equal(expected, objects)


def test_a_tree_ensure_host_cannot_follow_is_written_whole_at_load(tmp_path, on_cpu_device, monkeypatch) -> None:
    torch.manual_seed(4)
    weights = nn.Linear(300, 200)
    expected = _saved(tmp_path, {"w": weights})
    monkeypatch.setattr(device_image, "follows", lambda obj: False)
    files_filled = []
    real_fill = device_image.fill_host
    monkeypatch.setattr(device_image, "fill_host", lambda im: files_filled.append(im.host.numel()) or real_fill(im))
    _scramble({"w": weights})
    _restore(tmp_path, {"w": weights})
    assert files_filled, "the host was not written before the loaded tree was handed on"
    _assert_equal(expected, {"w": weights})


def _biggest(step_dir):
    return max((f for f in step_dir.iterdir() if f.name.endswith(".zst")), key=lambda f: f.stat().st_size)


def _forge(step_dir, victim, data: bytes, raw_size_delta: int = 0) -> None:
    """``victim`` now holds ``data``; the manifest and marker agree with it (every checksum passes)."""
    victim.write_bytes(data)

    def change(doc):
        for f in doc["files"]:
            if f["path"] == victim.name:
                f.update(size=len(data), checksum=f"crc32:{zlib.crc32(data):08x}", raw_size=f["raw_size"] + raw_size_delta)

    tamper.rewrite_manifest(step_dir, change)


def _block_end_moved(data: bytes) -> bytes:
    """``data`` with the first block of its first Huffman plane ending one bit later (nothing else changed)."""
    stored = memoryview(data)
    frames, natives = read_index(ViewFile(stored), PLANES_FOOTER_MAGIC, "zstd-planes")
    chunks, _, _ = planes_device._plan(stored, frames, natives, True)
    plane = next(p for c in chunks for p in c.on_device.values())
    at = plane.src + huffman.HEADER.size + 128
    out = bytearray(data)
    first, second = struct.unpack_from("<II", out, at)
    assert first + 1 <= second
    struct.pack_into("<I", out, at, first + 1)
    return bytes(out)


@pytest.mark.parametrize("forgery", ["raw size", "Huffman block end"])
def test_a_forged_planes_file_is_refused_on_the_device_path_and_nothing_changes(tmp_path, on_cpu_device, bulk_on_cpu,
                                                                                 forgery) -> None:
    model, opt = _trained(5)
    objects = {"model": model, "optim": opt}
    _saved(tmp_path, objects)
    step_dir = tmp_path / "step-000000001"
    victim = _biggest(step_dir)
    data = victim.read_bytes()
    if forgery == "raw size":
        _forge(step_dir, victim, data, raw_size_delta=1)
    else:
        _forge(step_dir, victim, _block_end_moved(data))
    _scramble(objects)
    live = _snapshot(model)
    before = dict(device_image.stats)
    with CheckpointManager(str(tmp_path), objects, compression="zstd-planes") as mgr:
        with pytest.raises(CorruptCheckpointError, match="native bytes|decodes to|escape"):
            mgr.restore(1)
    assert device_image.stats["verified"] > before["verified"]  # checked on the "device" first
    assert all(torch.equal(a, b) for a, b in zip(live.values(), _snapshot(model).values()))


def _frame_magic_broken(data: bytes) -> bytes:
    """``data`` with the frame magic of its first chunk that holds native bytes changed (its layout no longer parses)."""
    frames, natives = read_index(ViewFile(memoryview(data)), PLANES_FOOTER_MAGIC, "zstd-planes")
    first = next(i for i in range(len(frames) - 1) if natives[i + 1] > natives[i])
    out = bytearray(data)
    out[frames[first]] ^= 0xFF
    return bytes(out)


@pytest.mark.parametrize("damage", ["layout", "Huffman block end"])
@pytest.mark.parametrize("manifest", ["agrees", "disagrees"])
def test_both_parts_of_the_decoding_begin_before_the_checksum_and_count_only_after(tmp_path, on_cpu_device, bulk_on_cpu,
                                                                                 monkeypatch, manifest, damage) -> None:
    """The host's part beside the upload (every file's on the one planning thread), the device's part before the checksum
    is compared; what either finds is reported only for a file that matched its checksum."""
    model, opt = _trained(6)
    objects = {"model": model, "optim": opt}
    expected = _saved(tmp_path, objects)
    threads, given, events = [], [], []
    real_prepare, real_decode, real_check = device_decode.prepare, device_decode.decode_on_device, restore.check_file

    def spied_prepare(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return real_prepare(*args, **kwargs)

    def spied_decode(stored, *args, **kwargs):
        given.append(kwargs.get("prepared"))
        events.append(("decode", stored.nbytes))
        return real_decode(stored, *args, **kwargs)

    def spied_check(where, entry, *args):
        events.append(("checksum", entry.path))
        return real_check(where, entry, *args)

    monkeypatch.setattr(device_decode, "prepare", spied_prepare)
    monkeypatch.setattr(device_decode, "decode_on_device", spied_decode)
    monkeypatch.setattr(restore, "check_file", spied_check)
    _scramble(objects)
    got = _restore(tmp_path, objects)
    _assert_equal(expected, objects)
    assert len(threads) == 2 and set(threads) == {"checkpointd-plan_0"}
    assert len(given) == len(threads) and all(isinstance(p, planes_device.Prepared) for p in given)
    step_dir = tmp_path / "step-000000001"
    planes_files = {f.name: f.stat().st_size for f in step_dir.iterdir() if f.name.endswith(".zst")}
    assert len(planes_files) == 2 and got["decoded"] == 2
    for name, size in planes_files.items():  # decoded once, before its checksum was compared
        assert events.count(("decode", size)) == 1
        assert events.index(("decode", size)) < events.index(("checksum", name))

    victim = _biggest(step_dir)
    if damage == "layout":  # found by the host's part
        broken = _frame_magic_broken(victim.read_bytes())
        found = r"chunk \d+ \(file byte \d+\): bad chunk frame header"
    else:  # found by the device's part
        broken = _block_end_moved(victim.read_bytes())
        found = "does not decode to its symbols"
    if manifest == "agrees":
        _forge(step_dir, victim, broken)
        wanted = found
    else:
        victim.write_bytes(broken)
        wanted = "fails its checksum"  # what the decoding found is not reported: the bytes were not the file's
    _scramble(objects)
    live = _snapshot(model)
    threads.clear()
    events.clear()
    with CheckpointManager(str(tmp_path), objects, compression="zstd-planes") as mgr:
        with pytest.raises(CorruptCheckpointError, match=wanted):
            mgr.restore(1)
    assert threads, "the damaged file's host part was not made beside its upload"
    if damage != "layout":  # (a file whose layout does not parse is not given to the device)
        assert ("decode", len(broken)) in events
    assert all(torch.equal(a, b) for a, b in zip(live.values(), _snapshot(model).values()))


def test_a_forked_child_starts_the_pools_again() -> None:
    """The shared zstd pool and the planning thread start again in a forked child: the parent's threads
    are not there, and a task given to the parent's pool would never run."""
    assert compress.default_executor().submit(int, 1).result() == 1
    assert device_decode._planner().submit(int, 2).result() == 2
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            ok = compress.default_executor().submit(int, 3).result(timeout=10) == 3 and \
                device_decode._planner().submit(int, 4).result(timeout=10) == 4
        except BaseException:
            ok = False
        os._exit(0 if ok else 3)
    deadline = time.monotonic() + 30
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child's tasks never ran")
        time.sleep(0.02)
    assert os.waitstatus_to_exitcode(status) == 0
    assert device_decode._planner().submit(int, 5).result(timeout=10) == 5  # the parent's are untouched
