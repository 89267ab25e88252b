"""Host-to-device copies through a ring of pinned chunks (the bounce), finished on return.

Why: pinning a whole read buffer costs about 0.4-0.5 s per GiB, more than the copy itself, and a
pageable copy is synchronous and slow (12-18 GB/s on H100/H200 hosts, far less for small tensors). Here
the bytes go through :data:`BOUNCE_CHUNKS` reused pinned chunks of :data:`CHUNK_BYTES`: each chunk is
filled by one ``copy_`` that torch spreads over its intra-op threads, then pushed to the GPU on a side
stream, so the next chunk's host copy overlaps this chunk's DMA. Pairs under :data:`PACK_BELOW_BYTES`
share chunks.

Why torch's intra-op threads and one Python thread, not a Python thread per chunk: every Python-level
step of a chunk (the memcpy call, the launch, the event) drops and retakes the GIL, and with 16 threads
each retake waits its turn. On a 16-core H200 host (4.8 GB, 240 tensors, tmpfs mapping into live CUDA
tensors) 16 Python threads with two 8 MiB chunks each take 150 ms (33 GB/s), one thread with 16
intra-op threads and four 16 MiB chunks 103 ms (49 GB/s; 64 MiB chunks 111 ms; 8 intra-op threads
134 ms).

Where :mod:`checkpointd.native.upload` loads, the bounce runs there instead: the same pinned chunks cut
into slots, native threads, no GIL held (H200, 4.83 GB from tmpfs: 49 GB/s against 35 through the
Python bounce). Without it (no compiler, native code turned off by :func:`checkpointd.options.native_enabled`)
the Python bounce copies the same bytes.

The pinned chunks are kept until a save commits (:func:`release_pinned`). Every copy is finished
(streams synchronised) before a function here returns, so callers and the training loop may use the
tensors at once, on any stream.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import Any, Iterator

import torch

from checkpointd.native import upload as upload_native
from checkpointd.storage.lanes import local_ranks

logger = logging.getLogger("checkpointd")

Pair = tuple[torch.Tensor, torch.Tensor]
"""``(destination, source)``: two 1-D uint8 tensors of the same length."""

COPY_THREADS: int | None = None
"""Threads for the host side of a bounce (torch intra-op threads, or native upload workers); None (the
default): three quarters of this process's share of the cores, at most 16: ``min(16, max(2, 3/4 cpus /
local ranks))``. The other quarter is left to the restore's own work beside its uploads (parsing,
planning the decoding of a compressed file): on an H200 host (16 cores, 4.83 GB from tmpfs) a
``zstd-planes`` restore took 144-168 ms (best, median of 8) with 12 threads against 168-209 with 16, an
uncompressed one 138-171 against 144-177. A bounce raises
torch's intra-op thread count to this for the copy when it is lower (``torchrun`` sets 1 per rank) and
puts it back after."""
CHUNK_BYTES = 16 << 20
"""Size of each pinned chunk: a bounce pins ``BOUNCE_CHUNKS x CHUNK_BYTES`` bytes (64 MiB by default)."""
BOUNCE_CHUNKS = 4
"""Pinned chunks a bounce cycles through: one being filled while the others' DMAs drain."""
PACK_BELOW_BYTES = 1 << 20
"""Pairs smaller than this share pinned chunks (:func:`bounced_h2d`); 0 gives each pair chunks of its own.

Why: each chunk costs the copying thread tens of microseconds of Python and CUDA calls (slicing, the
host copy, the DMA's launch, an event), whatever its size. A typical restore of 320 tensors holds 224
under 1 MiB (biases, norms, fused AdamW's ``step`` scalars). Packed, they cost one host gather
(``torch._foreach_copy_``), one DMA into device scratch (at most ``BOUNCE_CHUNKS x CHUNK_BYTES``, for the
copy's duration) and one fused device-side scatter per chunk. On an H200 host (4.83 GB, tmpfs) the bulk
copy takes 109-145 ms packed against 125-157 ms with a chunk per pair."""


def copy_threads() -> int:
    """:data:`COPY_THREADS`, or three quarters of this process's share of the cores (at most 16)."""
    if COPY_THREADS is not None:
        return max(1, COPY_THREADS)
    return min(16, max(2, (os.cpu_count() or 2) * 3 // 4 // local_ranks()))


@contextlib.contextmanager
def _intra_op_threads(wanted: int) -> Iterator[None]:
    """At least ``wanted`` intra-op threads for the block (torch's setting put back after it)."""
    current = torch.get_num_threads()
    raised = False
    if current < wanted:
        try:
            torch.set_num_threads(wanted)
            raised = True
        except RuntimeError:  # a parallel backend that cannot change now: copy with what there is
            pass
    try:
        yield
    finally:
        if raised:
            torch.set_num_threads(current)


class _DevicePool:
    """A device's side stream (kept) and :data:`BOUNCE_CHUNKS` pinned chunks (until :func:`release_pinned`)."""

    def __init__(self, device: torch.device, threads: int, chunk: int) -> None:
        self.device = device
        self.threads = threads
        self.chunk = chunk
        self.lock = threading.Lock()
        with torch.cuda.device(device):
            self.stream = torch.cuda.Stream(device)
        self.pinned: list[torch.Tensor] | None = None

    def pinned_chunks(self) -> list[torch.Tensor]:
        if self.pinned is None:
            self.pinned = [torch.empty(self.chunk, dtype=torch.uint8, pin_memory=True) for _ in range(BOUNCE_CHUNKS)]
        return self.pinned


_pools: dict[tuple[str, int | None, int, int], _DevicePool] = {}
_pools_lock = threading.Lock()


def _pool(device: torch.device) -> _DevicePool:
    threads, chunk = copy_threads(), max(1, CHUNK_BYTES)
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (device.type, index, threads, chunk)
    with _pools_lock:
        if key not in _pools:
            _pools[key] = _DevicePool(torch.device(device.type, index), threads, chunk)
        return _pools[key]


def release_pinned() -> None:
    """Give the bounce chunks' pinned memory back (``BOUNCE_CHUNKS x CHUNK_BYTES``, 64 MiB by default).

    Why: a restore happens once per process, at resume, and the staging arena pinned for the saves
    that follow is the state's size; keeping the pool as well would put pinned memory above the 1.05x
    of the state that the training's host budget allows (20 % over for a 1.3 GB state). The writer
    calls this after each committed save, on its own thread (``cudaFreeHost`` waits for the device);
    a later restore pins the pool again (~0.1-0.2 s).
    """
    released = False
    with _pools_lock:
        pools = list(_pools.values())
    for pool in pools:
        with pool.lock:  # never while a copy uses the chunks
            if pool.pinned is not None:
                pool.pinned = None
                released = True
    empty = getattr(torch._C, "_host_emptyCache", None)
    if released and empty is not None:
        empty()  # the caching host allocator keeps freed blocks pinned until asked


def upload_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy the CPU bytes ``src`` into the CUDA bytes ``dst`` (both 1-D uint8) through the pinned chunks;
    finished on return (:mod:`checkpointd.restore.device_image` uploads a mapped file with it).

    :func:`bounced_h2d` copies it: natively where :func:`uploads_off_gil`, else the Python bounce. The copy
    threads fault a fresh mapping's pages in as they read. Mapping them ahead on other threads
    (``MADV_POPULATE_READ``, every chunk queued at once) makes a restore of 4.83 GB slower on H200 hosts
    in every variant measured: best 221 and 204 ms with 2 and 4 threads against 160 without, 213 with 16
    against 181, presumably the populating threads competing with the copy's."""
    bounced_h2d(dst.device, [(dst, src)])


def uploads_off_gil() -> bool:
    """Whether the bounce (:func:`upload_bytes`, :func:`bounced_h2d`) runs holding no GIL: the native
    upload (:mod:`checkpointd.native.upload`) loads.

    A restore then parses files beside the uploads (:func:`checkpointd.restore.fastload.read_file_verified`);
    beside the Python bounce that makes restores slower."""
    return upload_native.library() is not None


def device_to_device(device: torch.device, items: list[Pair]) -> None:
    """Copies between buffers of one device, on a side stream after the training's queued work; finished on return."""
    pool = _pool(device)
    stream = pool.stream
    with pool.lock:
        stream.wait_stream(torch.cuda.current_stream(pool.device))
        with torch.cuda.device(pool.device), torch.cuda.stream(stream):
            torch._foreach_copy_([dst for dst, _ in items], [src for _, src in items])  # fused launches
        stream.synchronize()


class _Ring:
    """The pinned chunks a bounce cycles through, each reused once the device has finished with it."""

    def __init__(self, slots: int, stream: Any) -> None:
        self.stream = stream
        self.events: list[torch.cuda.Event | None] = [None] * slots
        self.slot = 0

    def take(self) -> int:
        """The next chunk's index, once the work queued on it last has finished."""
        done = self.events[self.slot]
        if done is not None:
            done.synchronize()
        return self.slot

    def queued(self) -> None:
        """Mark the work just queued on the taken chunk (its DMA, and what reads the DMA's target) and move on."""
        event = torch.cuda.Event()
        event.record(self.stream)
        self.events[self.slot] = event
        self.slot = (self.slot + 1) % len(self.events)


def _packs(items: list[Pair], limit: int) -> list[list[Pair]]:
    """Consecutive groups of ``items`` of at most ``limit`` bytes together."""
    packs: list[list[Pair]] = []
    size = limit
    for pair in items:
        n = pair[0].numel()
        if size + n > limit:
            packs.append([])
            size = 0
        packs[-1].append(pair)
        size += n
    return packs


def bounced_h2d(device: torch.device, items: list[Pair]) -> None:
    """Chunk by chunk: host copy into a pinned chunk (intra-op threads), then its DMA on a side stream.

    Pairs below :data:`PACK_BELOW_BYTES` are packed: gathered into one chunk on the host, sent in one
    DMA to a device-side chunk, scattered from there by one fused copy.

    Natively instead where :func:`uploads_off_gil` (every pair a range of the native upload, small ones
    in slot-sized pieces of their own: no GIL held, nothing packed), falling back to the above if that fails."""
    pool = _pool(device)
    if uploads_off_gil():
        with pool.lock:  # the chunks are the pool's: one copy at a time uses them
            try:
                upload_native.upload_pairs(items, pool.pinned_chunks(), pool.threads)
                return
            except Exception as exc:  # noqa: BLE001 - an optional accelerator: the Python bounce copies the same bytes
                logger.warning("checkpointd: the native upload failed (%r); copying through the Python bounce", exc)
    below = min(PACK_BELOW_BYTES, pool.chunk)  # a pack fits one chunk
    small = [p for p in items if p[0].numel() < below]
    large = [p for p in items if p[0].numel() >= below]
    with pool.lock, _intra_op_threads(pool.threads):
        chunks = pool.pinned_chunks()
        stream = pool.stream
        stream.wait_stream(torch.cuda.current_stream(pool.device))  # the training's queued work comes first
        ring = _Ring(len(chunks), stream)
        with torch.cuda.device(pool.device), torch.cuda.stream(stream):
            if small:  # device scratch for the packs: a chunk's worth for each pinned chunk at most
                width = min(pool.chunk, sum(d.numel() for d, _ in small))
                landing = torch.empty((len(chunks), width), dtype=torch.uint8, device=pool.device)
                for pack in _packs(small, pool.chunk):
                    slot = ring.take()
                    spans, end = [], 0
                    for dst, _ in pack:
                        spans.append((end, end + dst.numel()))
                        end += dst.numel()
                    torch._foreach_copy_([chunks[slot][a:b] for a, b in spans], [src for _, src in pack])
                    landing[slot, :end].copy_(chunks[slot][:end], non_blocking=True)
                    torch._foreach_copy_([dst for dst, _ in pack], [landing[slot, a:b] for a, b in spans])
                    ring.queued()
            for dst, src in large:
                n = dst.numel()
                for a in range(0, n, pool.chunk):
                    b = min(n, a + pool.chunk)
                    slot = ring.take()
                    buf = chunks[slot][: b - a]
                    buf.copy_(src[a:b])
                    dst[a:b].copy_(buf, non_blocking=True)
                    ring.queued()
        stream.synchronize()


__all__ = ["BOUNCE_CHUNKS", "CHUNK_BYTES", "COPY_THREADS", "PACK_BELOW_BYTES", "Pair", "bounced_h2d", "copy_threads",
           "device_to_device", "release_pinned", "upload_bytes", "uploads_off_gil"]
