"""Bulk copies of stored (CPU) tensors into live tensors: all pairs at once, H2D through a pinned pool.

Why: restore used to copy tensor by tensor with pageable host->device copies (``load_state_dict``:
one synchronous pageable copy at a time, 12-18 GB/s on H100/H200 hosts, far less for the small
tensors), while pinning the whole read buffer costs about 0.4-0.5 s per GiB, more than the copy
itself. Here every host->device pair whose bytes can be copied as they are (same dtype, same strides,
dense) is split into 16 MiB chunks; each chunk is copied into one of four reused pinned chunks by one
``copy_`` that torch spreads over its intra-op threads, then pushed to the GPU on a side stream, so
the next chunk's host copy overlaps this chunk's DMA; pairs under 1 MiB share chunks
(:data:`PACK_BELOW_BYTES`). Everything else (dtype casts, layout changes, CPU destinations) is a plain
``copy_``, exactly what ``load_state_dict`` does.

Why torch's intra-op threads and one Python thread, not a Python thread per chunk: every Python-level
step of a chunk (the memcpy call, the launch, the event) drops and retakes the GIL, and with 16
threads each retake waits its turn. On a 16-core H200 host (4.8 GB, 240 tensors, tmpfs mapping into
live CUDA tensors) 16 Python threads with two 8 MiB chunks each took 150 ms (33 GB/s; with 1 MiB
chunks 4x slower), one thread with 16 intra-op threads and four 16 MiB chunks 103 ms (49 GB/s; 64 MiB
chunks 111 ms; 8 intra-op threads 134 ms).

Strategies (``CHECKPOINTD_RESTORE_H2D``, so a benchmark can compare them in one run):

- ``auto`` (default): ``bounce`` when there is CUDA work of at least ``AUTO_MIN_BYTES``, else ``serial``;
- ``bounce``: the pinned pool above;
- ``pageable``: Python threads (``CHECKPOINTD_RESTORE_THREADS``), each doing pageable ``non_blocking`` copies;
- ``serial``: one ``copy_`` per pair on the current stream (the behaviour before bulk copies);
- ``legacy`` is handled by :mod:`checkpointd.restore.apply` (no bulk apply at all).

``CHECKPOINTD_RESTORE_THREADS`` (default ``min(16, cpus / local ranks)``) is also the intra-op thread
count a bounce uses: raised for the copy when torch's is lower (``torchrun`` sets 1 per rank) and put
back after. ``CHECKPOINTD_RESTORE_CHUNK_MB`` (default 16) sizes the chunks: ``4 x chunk`` bytes of
pinned memory, kept until a save commits (:func:`release_pinned`).
Every copy is finished (streams synchronised) before :func:`copy_pairs` returns, so callers and the
training loop may use the tensors at once, on any stream. CPU-only builds only ever do plain copies.

Where :mod:`checkpointd.native.upload` is built, the bounce (:func:`copy_pairs`' and :func:`upload_bytes`',
a mapped file's image for the device checksum) runs there instead: the same pinned chunks cut into
slots, native threads, no GIL held (H200, 4.83 GB from tmpfs: 49 GB/s against 35; RESULTS.md, session 34).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator, Sequence

import torch

from checkpointd.restore import device_image
from checkpointd.native import upload as upload_native
from checkpointd.storage.lanes import local_ranks

logger = logging.getLogger("checkpointd")

H2D_ENV = "CHECKPOINTD_RESTORE_H2D"
THREADS_ENV = "CHECKPOINTD_RESTORE_THREADS"
CHUNK_ENV = "CHECKPOINTD_RESTORE_CHUNK_MB"
STRATEGIES = ("auto", "bounce", "pageable", "serial", "legacy")
AUTO_MIN_BYTES = 32 << 20
"""Below this much host->device data the pool's threads cost more than they save."""

Pair = tuple[torch.Tensor, torch.Tensor]


def h2d_strategy() -> str:
    s = os.environ.get(H2D_ENV, "auto").strip().lower() or "auto"
    if s not in STRATEGIES:
        raise ValueError(f"{H2D_ENV}={s!r}: expected one of {', '.join(STRATEGIES)}")
    return s


BOUNCE_CHUNKS = 4
"""Pinned chunks a bounce cycles through: one being filled while the others' DMAs drain."""


def _threads() -> int:
    """Threads for the host side of the copies: the environment's, else this process's share of 16 cores."""
    env = os.environ.get(THREADS_ENV)
    if env:
        return max(1, int(env))
    return min(16, max(2, (os.cpu_count() or 2) // local_ranks()))


def _chunk_bytes() -> int:
    return max(1, int(float(os.environ.get(CHUNK_ENV, "16")) * (1 << 20)))


@contextlib.contextmanager
def _intra_op_threads(wanted: int) -> Iterator[None]:
    """At least ``wanted`` intra-op threads for the block (torch's setting put back after it)."""
    before = torch.get_num_threads()
    raised = False
    if before < wanted:
        try:
            torch.set_num_threads(wanted)
            raised = True
        except RuntimeError:  # a parallel backend that cannot change now: copy with what there is
            pass
    try:
        yield
    finally:
        if raised:
            torch.set_num_threads(before)


def is_dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: the elements fill ``[storage_offset, storage_offset + numel)`` exactly."""
    if t.layout != torch.strided:
        return False
    expected = 1
    dims = sorted(((st, s) for s, st in zip(t.shape, t.stride()) if s != 1))
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A dense tensor's memory as a 1-D uint8 view (whatever its strides)."""
    return t.as_strided((t.numel(),), (1,)).view(torch.uint8)


def raw_copyable(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """True when copying ``src`` into ``dst`` is the same as copying their bytes (CPU -> CUDA only)."""
    return (
        dst.device.type == "cuda" and src.device.type == "cpu"
        and dst.dtype == src.dtype and dst.shape == src.shape and dst.stride() == src.stride()
        and dst.numel() > 0 and not dst.is_quantized and not src.is_quantized
        and not src.is_conj() and not src.is_neg() and not dst.is_conj() and not dst.is_neg()
        and type(dst) in (torch.Tensor, torch.nn.Parameter) and type(src) in (torch.Tensor, torch.nn.Parameter)
        and is_dense(dst) and is_dense(src)
    )


def copy_pairs(pairs: Sequence[Pair], strategy: str | None = None) -> None:
    """``dst.copy_(src)`` for every pair, finished on return; byte-copyable CPU -> CUDA pairs in bulk.

    Pairs must have distinct destinations (callers keep the last of duplicates, as a sequential
    ``load_state_dict`` would end with it).
    """
    strategy = strategy or h2d_strategy()
    bulk: dict[torch.device, list[Pair]] = {}
    with torch.no_grad():
        for dst, src in pairs:
            if strategy != "serial" and raw_copyable(dst, src):
                bulk.setdefault(dst.device, []).append((flat_bytes(dst), flat_bytes(src)))
            else:
                dst.copy_(src)
        for device, items in bulk.items():
            total = sum(d.numel() for d, _ in items)
            how = strategy
            if how == "auto":
                how = "bounce" if total >= AUTO_MIN_BYTES else "serial"
            from_image, items = device_image.take_from_images(items, device)
            if from_image:  # verified bytes already on the device (a restore that verified there)
                _device_to_device(device, from_image)
            if not items:
                continue
            if how == "serial":
                for d, s in items:
                    d.copy_(s)
            elif how == "bounce":
                _bounced_h2d(device, items)
            else:
                _pageable_h2d(device, items)


# -- the host -> device copies: pooled streams, threads, pinned chunks ----------------------------------


class _DevicePool:
    """Per-device streams (kept) and, for bounce, :data:`BOUNCE_CHUNKS` pinned chunks (until :func:`release_pinned`)."""

    def __init__(self, device: torch.device, threads: int, chunk: int) -> None:
        self.device = device
        self.threads = threads
        self.chunk = chunk
        self.lock = threading.Lock()
        with torch.cuda.device(device):
            self.streams = [torch.cuda.Stream(device) for _ in range(threads)]
        self.pinned: list[torch.Tensor] | None = None

    def pinned_chunks(self) -> list[torch.Tensor]:
        if self.pinned is None:
            self.pinned = [torch.empty(self.chunk, dtype=torch.uint8, pin_memory=True) for _ in range(BOUNCE_CHUNKS)]
        return self.pinned


_pools: dict[tuple[str, int | None, int, int], _DevicePool] = {}
_pools_lock = threading.Lock()
_executor: ThreadPoolExecutor | None = None


def _pool(device: torch.device) -> tuple[_DevicePool, ThreadPoolExecutor]:
    global _executor
    threads, chunk = _threads(), _chunk_bytes()
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (device.type, index, threads, chunk)
    with _pools_lock:
        if key not in _pools:
            _pools[key] = _DevicePool(torch.device(device.type, index), threads, chunk)
        if _executor is None or _executor._max_workers < threads:  # noqa: SLF001 - grow once if asked for more
            _executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="checkpointd-h2d")
        return _pools[key], _executor


def release_pinned() -> None:
    """Give the bounce chunks' pinned memory back (``4 x chunk``, 64 MiB by default).

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


def _pieces(items: list[Pair], chunk: int) -> list[Pair]:
    out = []
    for d, s in items:
        n = d.numel()
        for a in range(0, n, chunk):
            b = min(n, a + chunk)
            out.append((d[a:b], s[a:b]))
    out.sort(key=lambda p: -p[0].numel())  # big pieces first, small ones fill the tail
    return out


def _pageable_h2d(device: torch.device, items: list[Pair]) -> None:
    """Python threads, each with its own stream, doing pageable ``non_blocking`` copies of 16 MiB pieces."""
    pool, executor = _pool(device)
    with pool.lock:
        pieces = _pieces(items, pool.chunk)
        current = torch.cuda.current_stream(pool.device)
        nxt = iter(range(len(pieces)))
        take = threading.Lock()
        threads = min(pool.threads, len(pieces))

        def next_piece() -> Pair | None:
            with take:
                i = next(nxt, None)
            return None if i is None else pieces[i]

        def work(k: int) -> None:
            stream = pool.streams[k]
            stream.wait_stream(current)  # whatever the training queued on these tensors comes first
            with torch.cuda.device(pool.device), torch.cuda.stream(stream):
                while (piece := next_piece()) is not None:
                    dst, src = piece
                    dst.copy_(src, non_blocking=True)
            stream.synchronize()

        futures = [executor.submit(work, k) for k in range(threads)]
        errors = []
        for f in futures:
            try:
                f.result()
            except BaseException as exc:  # noqa: BLE001 - every worker is waited for first
                errors.append(exc)
        if errors:
            raise errors[0]


def upload_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy the CPU bytes ``src`` into the CUDA bytes ``dst`` (both 1-D uint8) through the pinned chunks;
    finished on return (:mod:`checkpointd.restore.device_image` uploads a mapped file with it).

    :func:`_bounced_h2d` copies it: natively where :func:`uploads_off_gil`, else the Python bounce. The copy
    threads fault a fresh mapping's pages in as they read. Mapping them ahead on other threads
    (``MADV_POPULATE_READ``, every chunk queued at once) made a restore of 4.83 GB slower on H200 hosts in
    every variant tried: best 221 and 204 ms with 2 and 4 threads against 160 without, 213 with 16 against
    181 (RESULTS.md, session 30), presumably the populating threads competing with the copy's."""
    _bounced_h2d(dst.device, [(dst, src)])


def uploads_off_gil() -> bool:
    """Whether the bounce (:func:`upload_bytes`, :func:`copy_pairs`) runs holding no GIL: the native upload
    (:mod:`checkpointd.native.upload`) is wanted and built.

    A restore then parses files beside the uploads (:func:`checkpointd.restore.fastload.read_file_verified`);
    beside the Python bounce that made restores slower."""
    return upload_native.wanted() and upload_native.library() is not None


def _device_to_device(device: torch.device, items: list[Pair]) -> None:
    """Copies between buffers of one device, on a side stream after the training's queued work; finished on return."""
    pool, _ = _pool(device)
    stream = pool.streams[0]
    with pool.lock:
        stream.wait_stream(torch.cuda.current_stream(pool.device))
        with torch.cuda.device(pool.device), torch.cuda.stream(stream):
            torch._foreach_copy_([dst for dst, _ in items], [src for _, src in items])  # fused launches
        stream.synchronize()


PACK_BELOW_BYTES = 1 << 20
"""Pairs smaller than this share pinned chunks (:func:`_bounced_h2d`); 0 gives each pair chunks of its own.

Why: each chunk costs the copying thread tens of microseconds of Python and CUDA calls (slicing, the
host copy, the DMA's launch, an event), whatever its size. The reference workload restores 320 tensors
of which 224 are under 1 MiB (biases, norms, fused AdamW's ``step`` scalars). Packed, they cost one host
gather (``torch._foreach_copy_``), one DMA into device scratch (at most ``4 x chunk`` bytes, for the
copy's duration) and one fused device-side scatter per chunk. Measured on an H200 host (4.83 GB, tmpfs,
eight restores each way, alternated; RESULTS.md, session 28): the bulk copy 109-145 ms packed against
125-157 ms a chunk per pair, a restore 17 ms faster on average."""


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


def _bounced_h2d(device: torch.device, items: list[Pair]) -> None:
    """Chunk by chunk: host copy into a pinned chunk (intra-op threads), then its DMA on a side stream.

    Pairs below :data:`PACK_BELOW_BYTES` are packed: gathered into one chunk on the host, sent in one
    DMA to a device-side chunk, scattered from there by one fused copy.

    Natively instead where :func:`uploads_off_gil` (every pair a range of the native upload, small ones
    in slot-sized pieces of their own: no GIL held, nothing packed), falling back to the above if that fails."""
    pool, _ = _pool(device)
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
        stream = pool.streams[0]
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


__all__ = ["H2D_ENV", "STRATEGIES", "copy_pairs", "flat_bytes", "h2d_strategy", "is_dense", "raw_copyable", "release_pinned",
           "upload_bytes", "uploads_off_gil"]
