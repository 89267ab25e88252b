"""``checkpointd.storage.pagemem``: populating a mapping's pages ahead, so that later touches fault no more."""

from __future__ import annotations

import resource
import sys

import pytest

from checkpointd.storage import pagemem
from checkpointd.storage import sharedmem

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or not sharedmem.supported(),
                                reason="MADV_POPULATE_* and memfd are Linux")

NBYTES = 32 << 20


def _faults_touching_every_page(slab: sharedmem.SharedSlab) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    slab.array[::4096] = 1
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_populated_pages_are_touched_without_faults() -> None:
    fresh = sharedmem.SharedSlab(NBYTES)
    populated = sharedmem.SharedSlab(NBYTES)
    try:
        ok = pagemem.populate_write(populated.address + 100, NBYTES - 100)  # an unaligned start is rounded down
        if not ok:
            pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
        assert _faults_touching_every_page(fresh) >= NBYTES // 4096 // 2  # control: fresh shared pages fault
        assert _faults_touching_every_page(populated) < 64
        assert int(populated.array[1:4096].sum()) == 0 and int(populated.array[4096]) == 1  # zeroed, then written
    finally:
        fresh.release()
        populated.release()


def test_populate_read_maps_without_error_and_missing_madvise_is_harmless(monkeypatch: pytest.MonkeyPatch) -> None:
    slab = sharedmem.SharedSlab(1 << 20)
    try:
        pagemem.populate_read(slab.address, 1 << 20)
        monkeypatch.setattr(pagemem, "_MADVISE", [None])  # no libc madvise: nothing done, nothing raised
        assert pagemem.populate_write(slab.address, 1 << 20) is False
        pagemem.populate_read(slab.address, 1 << 20)
    finally:
        slab.release()


def test_populate_on_several_threads_maps_every_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pagemem, "POPULATE_CHUNK_BYTES", 1 << 20)  # 32 chunks over 4 threads
    slab = sharedmem.SharedSlab(NBYTES)
    try:
        if not pagemem.populate_write(slab.address, NBYTES, threads=4):
            pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
        assert _faults_touching_every_page(slab) < 64
    finally:
        slab.release()


def _recording_madvise(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int]]:
    """Record every madvise call of pagemem (and still make it)."""
    real = pagemem._libc_madvise()
    assert real is not None, "this test needs libc's madvise"
    calls: list[tuple[int, int, int]] = []

    def spy(addr, length, advice):
        calls.append((addr.value, length.value, advice))
        return real(addr, length, advice)

    monkeypatch.setattr(pagemem, "_libc_madvise", lambda: spy)
    return calls


def _within(calls: list[tuple[int, int, int]], base: int, size: int) -> list[tuple[int, int, int]]:
    """The calls on ``[base, base + size)`` (a collection may release other tests' mappings meanwhile)."""
    return [c for c in calls if base <= c[0] < base + size]


def test_a_restore_mapping_drops_its_pages_in_pieces_when_the_last_view_dies(tmp_path, monkeypatch) -> None:
    """The read buffer of a restore (``fastload._map_file``) is released piece by piece, once nothing can reach it."""
    import gc
    import os

    import torch

    from checkpointd.restore import fastload

    size = (5 << 20) + 123
    data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    path = tmp_path / "blob"
    path.write_bytes(data.numpy().tobytes())
    monkeypatch.setattr(pagemem, "RELEASE_PIECE_BYTES", 1 << 20)
    calls = _recording_madvise(monkeypatch)
    fd = os.open(path, os.O_RDONLY)
    try:
        buf = fastload._map_file(fd, size)
    finally:
        os.close(fd)
    assert torch.equal(buf, data)
    base = buf.data_ptr()
    view = buf[size - 1000:]
    del buf
    gc.collect()
    assert _within(calls, base, size) == [], "a view still reaches the mapping: nothing released"
    assert torch.equal(view, data[size - 1000:])
    del view
    gc.collect()
    calls = _within(calls, base, size)
    assert [c[2] for c in calls] == [pagemem.MADV_DONTNEED] * 6
    assert [c[0] - base for c in calls] == [k << 20 for k in range(6)], "contiguous pieces from the start"
    assert [c[1] for c in calls] == [1 << 20] * 5 + [123], "each piece at most RELEASE_PIECE_BYTES, all of it covered"


def test_release_in_pieces_without_madvise_does_nothing(monkeypatch) -> None:
    monkeypatch.setattr(pagemem, "_libc_madvise", lambda: None)
    assert pagemem.release_in_pieces(4096, 1 << 20) == 0
    assert pagemem.release_in_pieces(0, 1 << 20) == 0


def test_staging_slabs_drop_their_pages_in_pieces_when_the_last_view_dies(monkeypatch) -> None:
    """An arena replaced during training (optimizer state appearing) goes without a multi-GB unmap at once."""
    import gc

    from checkpointd.save import arena

    monkeypatch.setattr(pagemem, "RELEASE_PIECE_BYTES", 1 << 20)
    gc.collect()  # other tests' mappings first
    calls = _recording_madvise(monkeypatch)
    private = arena.private_slab((3 << 20) + 4096)
    private.fill_(7)
    base = private.data_ptr()
    del private
    gc.collect()
    assert [(c[0] - base, c[1], c[2]) for c in _within(calls, base, (3 << 20) + 4096)] == [
        (0, 1 << 20, pagemem.MADV_DONTNEED), (1 << 20, 1 << 20, pagemem.MADV_DONTNEED),
        (2 << 20, 1 << 20, pagemem.MADV_DONTNEED), (3 << 20, 4096, pagemem.MADV_DONTNEED)]
    calls.clear()
    slab = sharedmem.SharedSlab(2 << 20)
    view = slab.array[:100]
    view[:] = 5
    address = slab.address
    slab.release()
    del slab
    gc.collect()
    assert _within(calls, address, 2 << 20) == [], "a view still reaches the shared mapping"
    assert int(view.sum()) == 500
    del view
    gc.collect()
    assert [(c[0] - address, c[1]) for c in _within(calls, address, 2 << 20)] == [(0, 1 << 20), (1 << 20, 1 << 20)]
