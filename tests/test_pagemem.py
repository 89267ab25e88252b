"""``checkpointd.pagemem``: populating a mapping's pages ahead, so that later touches fault no more."""

from __future__ import annotations

import resource
import sys

import pytest

from checkpointd import pagemem, sharedmem

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
