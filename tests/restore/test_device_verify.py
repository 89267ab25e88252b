"""Verify on the device (``device_crc``, ``device_image``): the arithmetic and the bookkeeping, on the CPU.

The GPU path (the NVRTC-built CUDA kernels, upload through pinned chunks, device-to-device apply) runs in
``tests/gpu/test_device_verify_cuda.py``. Here the CRC runs as torch ops on CPU tensors, and an image's
"device" is the CPU (the upload a plain copy), which exercises what must hold anywhere: the CRC equals
zlib's, a file verified this way is usable only once its checksum matched, it is found by the host
addresses of the mapped file, the restore drops it, and room, the switch and failures are honoured.
"""

from __future__ import annotations

import threading
import time
import zlib

import numpy as np
import pytest
import torch

from checkpointd import CheckpointManager, commit
from checkpointd.codecs import device_crc
from checkpointd.restore import device_image
from checkpointd.restore import fastload
from checkpointd.format import layout
from checkpointd.restore import step as restore
from checkpointd.errors import CorruptCheckpointError

CPU = torch.device("cpu")
VERIFY_ENV = "CHECKPOINTD_RESTORE_VERIFY"
"""Read by :func:`checkpointd.options.restore_verify_on`."""


@pytest.mark.parametrize("n", [0, 1, 3, 4095, 4096, 4097, 3 * 4096, 3 * 4096 + 5, 8 * 4096, 33 * 4096 + 4093, (1 << 20) + 3])
def test_crc_by_lanes_and_a_tree_equals_zlib(n) -> None:
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    assert device_crc.crc32_of(torch.from_numpy(data)) == zlib.crc32(data.tobytes())


def _kernels_in_numpy(body: torch.Tensor, lanes: int) -> int:
    """What ``device_crc.KERNEL_SOURCE``'s two kernels compute, step for step, from the very tables
    ``_raw_cuda_rows`` hands them: the lanes' slice-by-4 loop, then one combining pass per level."""
    levels = (lanes - 1).bit_length()
    slice_tab, combine_tab = device_crc._tables_int32(levels, CPU)
    assert slice_tab.dtype == combine_tab.dtype == torch.int32 and slice_tab.shape == (1024,)
    assert combine_tab.shape == (levels, 1024)
    t = slice_tab.numpy().view(np.uint32).reshape(4, 256)  # the kernel's __shared__ t[4][256]
    words = body.numpy().view(np.uint32).reshape(lanes, device_crc.LANE_BYTES // 4)
    c = np.zeros(lanes, dtype=np.uint32)
    for k in range(words.shape[1]):
        x = c ^ words[:, k]
        c = t[3][x & 255] ^ t[2][(x >> 8) & 255] ^ t[1][(x >> 16) & 255] ^ t[0][x >> 24]
    c = np.concatenate([np.zeros((1 << levels) - lanes, dtype=np.uint32), c])  # the leading zero lanes
    for r in range(levels):
        tab = combine_tab[r].numpy().view(np.uint32)
        a, b = c[0::2], c[1::2]
        c = tab[a & 255] ^ tab[256 + ((a >> 8) & 255)] ^ tab[512 + ((a >> 16) & 255)] ^ tab[768 + (a >> 24)] ^ b
    return int(c[0])


@pytest.mark.parametrize("lanes", [1, 2, 3, 5, 8, 13])
def test_the_cuda_kernels_arithmetic_and_tables_equal_zlib(monkeypatch, lanes) -> None:
    """The CUDA path's table layout and combining levels, run in numpy (the kernels themselves: tests/gpu)."""
    monkeypatch.setattr(device_crc, "_raw_cuda_rows",
                        lambda bodies: [torch.tensor(_kernels_in_numpy(b, n), dtype=torch.int64) for b, n in bodies])
    data = np.random.default_rng(lanes).integers(0, 256, lanes * 4096 + 77, dtype=np.uint8)
    assert device_crc.crc32_of(torch.from_numpy(data), use_kernel=True) == zlib.crc32(data.tobytes())


def test_crc_takes_the_tail_from_the_host_and_checks_its_length() -> None:
    data = np.random.default_rng(1).integers(0, 256, 3 * 4096 + 10, dtype=np.uint8)
    buf = torch.from_numpy(data)
    tail = data.tobytes()[device_crc.tail_start(len(data)):]
    assert len(tail) == 10
    assert device_crc.crc32_of(buf, host_tail=tail) == zlib.crc32(data.tobytes())
    wrong = bytearray(tail)
    wrong[0] ^= 1
    assert device_crc.crc32_of(buf, host_tail=bytes(wrong)) != zlib.crc32(data.tobytes())  # the tail counts
    with pytest.raises(ValueError, match="host_tail"):
        device_crc.crc32_of(buf, host_tail=tail[:-1])


def test_crc_rejects_what_it_cannot_read() -> None:
    with pytest.raises(ValueError, match="1-D uint8"):
        device_crc.crc32_of(torch.zeros(8192, dtype=torch.int32))
    with pytest.raises(ValueError, match="aligned"):
        device_crc.crc32_of(torch.zeros(3 * 4096, dtype=torch.uint8)[1:])


def test_one_changed_bit_anywhere_changes_the_crc() -> None:
    data = np.random.default_rng(2).integers(0, 256, 9 * 4096, dtype=np.uint8)
    base = device_crc.crc32_of(torch.from_numpy(data))
    for pos in (0, 4095, 4096, 5 * 4096 + 17, len(data) - 1):
        flipped = data.copy()
        flipped[pos] ^= 0x80
        assert device_crc.crc32_of(torch.from_numpy(flipped)) == zlib.crc32(flipped.tobytes()) != base


def _saved(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Linear(300, 7))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 64)).sum().backward()
    opt.step()
    with CheckpointManager(str(tmp_path), {"model": model, "optim": opt}, compression=None) as mgr:
        mgr.save(1)
        mgr.wait()
        store = mgr._store
    step_dir = layout.step_dir_name(1)
    return store, step_dir, commit.read_committed_manifest(store, step_dir)


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _tensors(v)


def _byte_pairs(contents):
    """``(destination, stored bytes)`` for every stored tensor, as ``bulkcopy.copy_pairs`` builds them."""
    return [(torch.empty(t.nbytes, dtype=torch.uint8), t.reshape(-1).view(torch.uint8))
            for t in _tensors(contents) if t.numel()]


@pytest.fixture
def mapped(monkeypatch):
    monkeypatch.setattr(fastload, "use_mmap", lambda path, size: size > 0)  # as on tmpfs in a CUDA process
    monkeypatch.setenv(VERIFY_ENV, "device")
    monkeypatch.setattr(device_image, "MIN_BYTES", 1)  # the test's files are small


def test_a_verified_file_is_found_by_its_stored_bytes_until_the_restore_ends(tmp_path, mapped, monkeypatch) -> None:
    store, step_dir, manifest = _saved(tmp_path)
    host_checksums = []
    monkeypatch.setattr(fastload, "_crc_task", lambda *a: host_checksums.append(a) or 0)
    before = dict(device_image.stats)
    with device_image.verifying_on(CPU):
        contents = restore.read_step(store, step_dir, manifest)
        assert device_image.stats["verified"] - before["verified"] == len(manifest.files)
        assert host_checksums == []  # no file was checksummed on the host
        pairs = _byte_pairs(contents)
        found, rest = device_image.take_from_images(pairs, CPU)
        assert len(found) == len(pairs) > 4 and rest == []
        for (dst, src), (_, image_bytes) in zip(pairs, found):
            assert image_bytes.data_ptr() != src.data_ptr()  # a copy, found by the source's address
            assert torch.equal(image_bytes, src)
    assert device_image.take_from_images(pairs, CPU) == ([], pairs)  # dropped with the restore


def test_a_file_that_fails_its_checksum_leaves_no_image(tmp_path, mapped) -> None:
    store, step_dir, manifest = _saved(tmp_path)
    victim = max((tmp_path / step_dir).iterdir(), key=lambda f: f.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the checksum can tell
    victim.write_bytes(bytes(data))
    before = device_image.stats["verified"]
    with device_image.verifying_on(CPU):
        with pytest.raises(CorruptCheckpointError, match="checksum"):
            restore.read_step(store, step_dir, manifest)
        assert device_image.stats["verified"] > before  # it was checksummed on the "device" ...
        registered = [im.host.numel() for r in device_image._active for im in r.images]
        assert len(data) not in registered  # ... and never registered (the other files' images may be)


def test_host_mode_and_no_restore_in_progress_verify_nothing_on_a_device(tmp_path, monkeypatch, mapped) -> None:
    store, step_dir, manifest = _saved(tmp_path)
    before = device_image.stats["verified"]
    monkeypatch.delenv(VERIFY_ENV, raising=False)
    assert device_image.mode() == "device"  # the default
    restore.read_step(store, step_dir, manifest)  # no restore into device tensors (e.g. checkpointd.load)
    assert device_image.stats["verified"] == before
    monkeypatch.setenv(VERIFY_ENV, "host")
    with device_image.verifying_on(CPU):
        restore.read_step(store, step_dir, manifest)
    assert device_image.stats["verified"] == before
    monkeypatch.delenv(VERIFY_ENV)
    with device_image.verifying_on(CPU):  # the default verifies on the device
        restore.read_step(store, step_dir, manifest)
    assert device_image.stats["verified"] > before
    monkeypatch.setenv(VERIFY_ENV, "gpu")
    with pytest.raises(ValueError, match="CHECKPOINTD_RESTORE_VERIFY"):
        device_image.mode()


def test_files_below_the_minimum_are_left_to_the_host(monkeypatch) -> None:
    monkeypatch.setenv(VERIFY_ENV, "device")
    r = device_image._Restore(CPU)
    device_image._active.append(r)
    try:
        buf = torch.arange(5000, dtype=torch.int32).view(torch.uint8)
        assert buf.numel() < device_image.MIN_BYTES and device_image.verify(buf) is None
        monkeypatch.setattr(device_image, "MIN_BYTES", 1)
        image, crc = device_image.verify(buf)
        assert crc == zlib.crc32(buf.numpy().tobytes()) and torch.equal(image.data, buf)
    finally:
        device_image._active.remove(r)


def test_a_failure_on_the_device_leaves_the_file_to_the_host(tmp_path, mapped, monkeypatch) -> None:
    store, step_dir, manifest = _saved(tmp_path)

    def broken(*a, **k):
        raise RuntimeError("kernel failed (test)")

    monkeypatch.setattr(device_crc, "crc32_start", broken)
    before = dict(device_image.stats)
    with device_image.verifying_on(CPU):
        contents = restore.read_step(store, step_dir, manifest)  # checksummed on the host instead
        assert device_image.take_from_images(_byte_pairs(contents), CPU)[0] == []
    assert device_image.stats["failed"] - before["failed"] == len(manifest.files)
    assert device_image.stats["verified"] == before["verified"]


def test_a_source_outside_or_across_an_image_is_left_to_the_host_copy() -> None:
    whole = torch.arange(200, dtype=torch.int64).to(torch.uint8)
    host = whole[:100]
    image = device_image.DeviceImage(host, host + 1)  # different bytes: shows where a source came from
    restore_ = device_image._Restore(CPU, [image])
    device_image._active.append(restore_)
    try:
        inside = (torch.empty(10, dtype=torch.uint8), host[10:20])
        across = (torch.empty(20, dtype=torch.uint8), whole[90:110])
        outside = (torch.empty(5, dtype=torch.uint8), whole[150:155])
        found, rest = device_image.take_from_images([inside, across, outside], CPU)
        assert [d for d, _ in found] == [inside[0]] and torch.equal(found[0][1], host[10:20] + 1)
        assert rest == [across, outside]
        assert device_image.take_from_images([inside], torch.device("meta")) == ([], [inside])  # another device
    finally:
        device_image._active.remove(restore_)


def test_room_counts_the_image_the_apply_and_what_other_files_were_promised(monkeypatch) -> None:
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (20 * gib, 80 * gib))
    r = device_image._Restore(torch.device("cuda", 0))
    assert device_image.headroom_bytes(80 * gib) == 4 * gib  # 5 % of the device
    assert device_image._has_room(r, 8 * gib)  # 20 - 2 x 8 = 4 left
    assert not device_image._has_room(r, 8 * gib + 1)
    r.promised = 2 * gib
    assert not device_image._has_room(r, 8 * gib)
    assert device_image._has_room(r, 7 * gib)


def test_an_apply_out_of_device_memory_runs_again_without_the_images(monkeypatch) -> None:
    calls = []

    def apply(entries, values):
        calls.append(sum(len(r.images) for r in device_image._active))
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (test)")

    monkeypatch.setattr(restore, "apply_entries", apply)
    monkeypatch.setenv(VERIFY_ENV, "device")
    host = torch.zeros(8, dtype=torch.uint8)
    with device_image.verifying_on(CPU):
        device_image.register(device_image.DeviceImage(host, host.clone()))
        restore._apply([], {})
    assert calls == [1, 0]
    calls.clear()
    with device_image.verifying_on(CPU), pytest.raises(torch.OutOfMemoryError):
        restore._apply([], {})  # nothing to give back: the error stands
    assert calls == [0]


def test_only_cuda_state_asks_for_a_device() -> None:
    model = torch.nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert device_image.target_device([model, opt, torch.zeros(2), {"plain": 1}]) is None


@pytest.mark.parametrize("levels_built", [1, 3, 24])
def test_every_file_size_slices_the_same_combining_tables(monkeypatch, levels_built) -> None:
    """Level k's table depends on k alone: one table of ``LEVELS_BUILT`` levels serves every smaller file,
    and a larger file gets its own."""
    monkeypatch.setattr(device_crc, "LEVELS_BUILT", levels_built)
    for levels in (1, 3, 5):
        slice_tab, combine = device_crc._tables_int32(levels, CPU)
        assert combine.shape == (levels, 1024)
        want = device_crc._level_tables(levels).reshape(levels, 1024).view(np.int32)
        assert np.array_equal(combine.numpy(), want)
    monkeypatch.setattr(device_crc, "_raw_cuda_rows",
                        lambda bodies: [torch.tensor(_kernels_in_numpy(b, n), dtype=torch.int64) for b, n in bodies])  # the CUDA path's use of the tables
    data = np.random.default_rng(5).integers(0, 256, 19 * device_crc.LANE_BYTES + 7, dtype=np.uint8)
    assert device_crc.crc32_of(torch.from_numpy(data), use_kernel=True) == zlib.crc32(data.tobytes())


def test_an_image_still_decoding_is_neither_registered_nor_copied_back_before_its_verdict() -> None:
    """A file decoded on the device is parsed while the device works; its verdict is taken (once) before
    the image is registered or any of its device bytes reach the host, and a damaged verdict raises."""
    host, data = torch.zeros(64, dtype=torch.uint8), torch.arange(64, dtype=torch.uint8)
    verdicts = []

    def damaged() -> None:
        verdicts.append(1)
        raise CorruptCheckpointError("a Huffman plane does not decode")

    image = device_image.DeviceImage(host, data, [(0, 64)], damaged)
    with pytest.raises(CorruptCheckpointError, match="does not decode"):
        device_image.fill_host(image)
    assert torch.equal(host, torch.zeros(64, dtype=torch.uint8)) and verdicts == [1]
    image = device_image.DeviceImage(host, data, [(0, 64)], damaged)
    with device_image.verifying_on(torch.device("cpu")):
        with pytest.raises(CorruptCheckpointError, match="does not decode"):
            device_image.register(image)
        assert device_image.take_from_images([(torch.empty(4, dtype=torch.uint8), host[:4])], torch.device("cpu"))[0] == []
    sound = device_image.DeviceImage(host, data, [(0, 64)], lambda: verdicts.append(2))
    device_image.fill_host(sound)
    device_image.fill_host(sound)  # the verdict is taken once
    assert torch.equal(host, data) and verdicts == [1, 1, 2]


class _FakeKernel:
    def __init__(self, fn) -> None:
        self.fn = fn

    def launch(self, grid, block, args, shared_bytes=0) -> None:
        self.fn(*args)


def _lanes_kernel(body, out, slice_tab, n) -> None:
    t = slice_tab.numpy().view(np.uint32).reshape(4, 256)
    words = body.numpy()[: n.value * device_crc.LANE_BYTES].view(np.uint32).reshape(n.value, -1)
    c = np.zeros(n.value, dtype=np.uint32)
    for k in range(words.shape[1]):
        x = c ^ words[:, k]
        c = t[3][x & 255] ^ t[2][(x >> 8) & 255] ^ t[1][(x >> 16) & 255] ^ t[0][x >> 24]
    out.numpy().view(np.uint32)[:] = c


def _combine_kernel(c, nxt, tab, n_out) -> None:
    c, tab = c.numpy().view(np.uint32), tab.numpy().view(np.uint32)
    a, b = c[0 : 2 * n_out.value : 2], c[1 : 2 * n_out.value : 2]
    nxt.numpy().view(np.uint32)[:] = tab[a & 255] ^ tab[256 + ((a >> 8) & 255)] ^ tab[512 + ((a >> 16) & 255)] ^ tab[768 + (a >> 24)] ^ b


def test_rows_of_many_buffers_combine_each_to_its_own_crc(monkeypatch) -> None:
    """How ``_raw_cuda_rows`` lays many buffers out (rows per power of two, zero lanes first) and combines
    them, with the kernels run in numpy (the kernels themselves: tests/gpu)."""
    monkeypatch.setattr(device_crc, "_cuda_kernels",
                        lambda device: {"crc32_lanes": _FakeKernel(_lanes_kernel),
                                        "crc32_combine_level": _FakeKernel(_combine_kernel)})
    rng = np.random.default_rng(9)
    datas = [rng.integers(0, 256, lanes * device_crc.LANE_BYTES + extra, dtype=np.uint8)
             for lanes, extra in ((1, 0), (2, 5), (3, 0), (5, 1), (8, 0), (13, 4095), (3, 7), (64, 0))]
    bodies = [(torch.from_numpy(d), d.size // device_crc.LANE_BYTES) for d in datas]
    raws = device_crc._raw_cuda_rows(bodies)
    for d, (_, lanes), raw in zip(datas, bodies, raws):
        body = lanes * device_crc.LANE_BYTES
        crc = device_crc._finish(int(raw.view(torch.int32).item()) & 0xFFFFFFFF, body, d[body:].tobytes())
        assert crc == zlib.crc32(d.tobytes()), (lanes, d.size)
    one = datas[5]
    assert device_crc.crc32_of(torch.from_numpy(one), use_kernel=True) == zlib.crc32(one.tobytes())  # _raw_cuda


def test_upload_turns_go_in_order_whatever_order_the_threads_come_in() -> None:
    turns, order = device_image.UploadTurns(), []

    def upload(i: int) -> None:
        turns.wait(i)
        order.append(i)
        turns.end(i)

    threads = [threading.Thread(target=upload, args=(i,)) for i in (3, 1, 2)]  # turn 0 is not uploaded at all
    for t in threads:
        t.start()
    time.sleep(0.05)
    assert order == []  # every upload waits for turn 0
    turns.end(0)
    for t in threads:
        t.join(10)
    assert order == [1, 2, 3]


def test_the_largest_file_uploads_first_when_a_smaller_one_is_read_first(tmp_path, mapped, monkeypatch) -> None:
    """A file uploads between its turn's ``wait`` and ``end``, so the order in which the waits return is
    the order of the uploads."""
    store, step_dir, manifest = _saved(tmp_path)
    largest = max(manifest.files, key=lambda f: f.size)
    assert sum(f.size == largest.size for f in manifest.files) == 1
    turns, sizes = [], {}
    real_read, real_verify, real_wait = fastload.read_file_verified, device_image.verify, device_image.UploadTurns.wait

    def late_for_the_largest(path, size, *args, **kwargs):
        if size == largest.size:
            time.sleep(0.2)  # the others reach their uploads first
        return real_read(path, size, *args, **kwargs)

    def verify_noting_size(buf, planes=None, turn=None):
        sizes[turn[1]] = buf.numel()
        return real_verify(buf, planes, turn)

    def wait_then_note(self, i):
        real_wait(self, i)
        turns.append(i)

    monkeypatch.setattr(fastload, "read_file_verified", late_for_the_largest)
    monkeypatch.setattr(device_image, "verify", verify_noting_size)
    monkeypatch.setattr(device_image.UploadTurns, "wait", wait_then_note)
    with device_image.verifying_on(CPU):
        contents = restore.read_step(store, step_dir, manifest)
    assert [sizes[i] for i in turns] == sorted((f.size for f in manifest.files), reverse=True)
    assert set(contents) == {f.path for f in manifest.files}
