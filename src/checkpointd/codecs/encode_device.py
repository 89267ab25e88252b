"""Encode float records into ``zstd-planes`` chunk frames on the GPU, from bytes that are already there.

Why: on the host, a planes chunk costs a core about 6 ms per 16 MiB (split, histogram, Huffman coding),
and the 16 threads of an H200 host encode 9-12 GB/s while the copies into the file need the same
cores: a 4.8 GB state takes about 0.4 s longer to commit than an uncompressed one
(``docs/performance.md``). With device staging the state already
sits in a private GPU copy; coding it there takes milliseconds, and only the coded bytes cross to the
host. The frames are the ones :func:`checkpointd.codecs.planes.encode_chunk` writes, byte for byte in
format (``docs/format.md``), so every decoder reads them, on any machine.

How, per batch of chunks (:data:`BATCH_BYTES` of native bytes), with the kernels of
:mod:`checkpointd.codecs.encode_kernels`:

1. The bytes of every plane of every chunk are counted on the device; the counts come back to the host
   (a few KiB), the next batch's while this one is coded.
2. The host chooses, per plane, a Huffman code or raw bytes, whichever is smaller (planes whose byte
   entropy looks uniform are not tried; a tensor's chunks in a batch share one code per plane, made
   from their summed counts), and lays every frame out: headers, plane tables and code lengths are
   made here and scattered into place.
3. On the device: each Huffman block's bits are summed, a cumulative sum gives every block's end
   (stored in its plane's block table) and first bit, the codes are written, and the raw planes too.
4. The frames are copied to the host on a stream of their own while the next batch is coded; each
   chunk's CRC-32 (of its stored planes) is computed there once its copy landed, on the codec pool, and
   written into its header.

Device memory beyond the source: at most :data:`WORK_BYTES` (two batches' frames, one being copied).

Guarded: the encoder reads its source three times, so the source must not change meanwhile (a private
device-staging copy does not). A block that would end anywhere but where the host's counts put it sets
a flag, and the whole call is refused (:class:`DeviceEncodeError`) rather than a frame used.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from checkpointd.codecs import huffman
from checkpointd.codecs.chunked import chunk_bounds
from checkpointd.codecs.container import FRAME_HEADER
from checkpointd.codecs.crc import crc32
from checkpointd.codecs.encode_kernels import KERNEL_SOURCE, NAMES, Chunk, Layout, histograms, stream_for, write_planes
from checkpointd.codecs.planes import (CHUNK_HEADER, FLAG_CRC_ALL, FLAG_ROTATED, PLANE, RANDOM_ENTROPY_BITS,
                                       SKIPPABLE_CHUNK_MAGIC, KIND_PLANES, MODE_HUFFMAN, MODE_RAW)
from checkpointd.errors import CheckpointError
from checkpointd.native import cuda_rtc

BATCH_BYTES = 256 << 20
"""Native bytes encoded per batch (a batch closes at the chunk that reaches it): the frames of a batch
live in one device buffer, and the host waits once per batch for its byte counts."""
WORK_BYTES = 2 * (BATCH_BYTES + (64 << 20))
"""The device memory the encoder needs beyond its source, at most: two batches' frames (a chunk more
than :data:`BATCH_BYTES` each, and their headers), the one before still being copied to the host."""
_PREFIX = FRAME_HEADER.size + CHUNK_HEADER.size
_CRC_AT = FRAME_HEADER.size + 12  # the CRC field of the chunk header ("<BBBxQI")
_HUFFMAN_HEAD = huffman.HEADER.size + huffman.LENGTHS_NBYTES


class DeviceEncodeError(CheckpointError):
    """The device encoder refused a batch (its source changed while it was read); nothing was written."""


@dataclass
class DeviceRecord:
    """The native bytes of one float record (``data``: uint8, 1-D, contiguous) and its element size.
    ``dest``: host bytes (uint8) of at least ``data``'s size, where the record's frames are written."""

    data: torch.Tensor
    itemsize: int
    dest: np.ndarray
    frames: list[tuple[int, int, int]] | None = field(default_factory=list)
    """``(offset in dest, frame bytes, native bytes)`` of each chunk frame, in order; None: the frames did
    not fit ``dest`` (the data is incompressible), and the caller stores the record another way."""
    used: int = 0


def available(device: torch.device) -> bool:
    """Whether records on ``device`` can be encoded there (the kernels build on a CUDA device; on the CPU
    the host kernels run, for tests)."""
    return device.type == "cpu" or cuda_rtc.kernels_available(KERNEL_SOURCE, NAMES, device,
                                                              "planes encoder (files are encoded on the host)")


def encode_records(records: Sequence[DeviceRecord], chunk_bytes: int, executor: Any = None, after: Any = None) -> None:
    """Encode ``records`` (all on one device) into planes frames in their ``dest``; fills each
    record's :attr:`DeviceRecord.frames`. CRCs are computed on ``executor`` (a pool) when given.
    ``after``: a CUDA event the sources are ready at (the encoder's stream waits for it).

    Raises:
        DeviceEncodeError: a batch's source changed while it was encoded.
    """
    if not records:
        return
    device = records[0].data.device
    for r in records:
        if r.data.dtype != torch.uint8 or r.data.dim() != 1 or not r.data.is_contiguous() or r.data.device != device:
            raise ValueError(f"a record must be contiguous uint8 bytes on {device}, got {r.data.dtype} "
                             f"{tuple(r.data.shape)} on {r.data.device}")
        if r.itemsize not in (2, 4, 8) or r.data.data_ptr() % r.itemsize or r.dest.nbytes < r.data.numel():
            raise ValueError(f"a record of {r.data.numel()} bytes cannot be encoded at element size {r.itemsize} "
                             f"into {r.dest.nbytes} host bytes")
        r.frames, r.used = [], 0
    stream = stream_for(device)
    if stream is not None and after is not None:
        stream.wait_event(after)
    flags: list[torch.Tensor] = []
    crcs: list[Any] = []
    try:
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            batches = _batches(records, chunk_bytes)
            batch = next(batches, None)
            counts = histograms(batch, device) if batch is not None else None
            while batch is not None and counts is not None:
                following = next(batches, None)  # its counts are made while this batch is coded
                counts_after = histograms(following, device) if following is not None else None
                landed = _encode_batch(batch, counts(), device, flags)
                crcs += _fill_crcs(landed, executor)
                batch, counts = following, counts_after
        for future in crcs:
            future.result()
        if flags and bool(torch.stack(flags).any()):
            raise DeviceEncodeError("the planes encoder's source changed while it was read; nothing was written")
    except BaseException:
        for r in records:
            r.frames = None
        _settle(device, crcs)  # nothing may still write into a dest that the caller fills another way
        raise


def _settle(device: torch.device, crcs: list[Any]) -> None:
    """Wait for every copy and checksum this call queued (after a failure; their own failures ignored)."""
    waits = [stream.synchronize for role in ("codes", "counts", "copies") if (stream := stream_for(device, role))]
    for wait in waits + [future.result for future in crcs]:
        try:
            wait()
        except Exception:  # noqa: BLE001 - the call fails anyway, with its first error
            pass


def _batches(records: Sequence[DeviceRecord], chunk_bytes: int) -> Iterator[list[Chunk]]:
    batch: list[Chunk] = []
    size = 0
    for r in records:
        for a, b in chunk_bounds(r.data.numel(), chunk_bytes):
            if r.frames is None:
                break
            batch.append(Chunk(r, a, b - a))
            size += b - a
            if size >= BATCH_BYTES:
                yield batch
                batch, size = [], 0
    if batch:
        yield batch


def _encode_batch(batch: list[Chunk], counts: np.ndarray, device: torch.device, flags: list[torch.Tensor]) -> list[Any]:
    """Queue one batch's kernels and its copy to the host; returns the frames to checksum once it landed
    (``(dest, offset, nbytes, event)``). A flag set on the device is appended to ``flags``."""
    layout = _lay_out(batch, counts)
    if not layout.nbytes:
        return []
    out = torch.zeros(layout.nbytes, dtype=torch.uint8, device=device)
    bad = torch.zeros(1, dtype=torch.int32, device=device)
    write_planes(batch, layout, out, bad)
    if layout.heads:
        index = np.concatenate([np.arange(at, at + len(blob), dtype=np.int64) for at, blob in layout.heads])
        values = np.frombuffer(b"".join(blob for _, blob in layout.heads), dtype=np.uint8).copy()
        out[cuda_rtc.table_to(device, torch.from_numpy(index))] = cuda_rtc.table_to(device, torch.from_numpy(values))
    flags.append(bad[0] != 0)
    return _download(batch, layout, out)


def _lay_out(batch: list[Chunk], counts: np.ndarray) -> Layout:
    """Choose every plane's mode and place every frame (a chunk whose record no longer fits is skipped).

    The chunks of one record in a batch share a code per plane, made from their summed counts (one
    tensor's chunks have one distribution); sizes are worked out for every plane at once."""
    layout = Layout()
    owner = {id(c.record): c.record for c in batch}
    index = {key: k for k, key in enumerate(owner)}
    of = np.array([index[id(c.record)] for c in batch])
    itemsize = np.array([c.itemsize for c in batch])
    count = np.array([c.count for c in batch], dtype=np.int64)
    summed = np.zeros((len(owner), 8, 256), dtype=np.int64)
    np.add.at(summed, of, counts)
    total = summed.sum(axis=2, keepdims=True)
    freq = summed / np.maximum(total, 1)
    entropy = -(freq * np.log2(np.where(summed > 0, freq, 1))).sum(axis=2)
    lengths = np.zeros((len(owner), 8, 256), dtype=np.uint8)
    coded = (total[..., 0] > 0) & (entropy < RANDOM_ENTROPY_BITS)  # (a uniform-looking plane is not tried)
    for k, j in zip(*np.nonzero(coded)):
        lengths[k, j] = huffman.code_lengths(summed[k, j])
    bits = (counts * lengths[of]).sum(axis=2)
    blocks = -(-count // huffman.BLOCK)
    huff_size = _HUFFMAN_HEAD + 4 * blocks[:, None] + (bits + 7) // 8
    huff = coded[of] & (huff_size < count[:, None]) & (np.arange(8) < itemsize[:, None])
    stored = np.where(huff, huff_size, count[:, None]) * (np.arange(8) < itemsize[:, None])
    code_of: dict[tuple[int, int], int] = {}  # (tensor, plane) -> its code in layout.codes
    for i, c in enumerate(batch):
        r, s = c.record, c.itemsize
        tail = c.nbytes - c.count * s
        size = _PREFIX + PLANE.size * s + int(stored[i].sum()) + tail
        if r.frames is None or r.used + size > r.dest.nbytes:  # incompressible: the caller stores it another way
            r.frames = None
            layout.frames.append((-1, 0))
            continue
        r.used += size
        at = layout.nbytes
        layout.frames.append((at, size))
        modes = [MODE_HUFFMAN if huff[i, j] else MODE_RAW for j in range(s)]
        layout.heads.append((at, FRAME_HEADER.pack(SKIPPABLE_CHUNK_MAGIC, size - FRAME_HEADER.size)
                             + CHUNK_HEADER.pack(KIND_PLANES, s, FLAG_ROTATED | FLAG_CRC_ALL, c.nbytes, 0)
                             + b"".join(PLANE.pack(modes[j], int(stored[i, j])) for j in range(s))))
        pos = at + _PREFIX + PLANE.size * s
        for j in range(s):
            if modes[j] == MODE_RAW:
                layout.raw[(i, j)] = pos
            else:
                if (int(of[i]), j) not in code_of:
                    code_of[(int(of[i]), j)] = len(layout.codes)
                    layout.codes.append(lengths[of[i], j])
                code = code_of[(int(of[i]), j)]
                packed = (layout.codes[code][0::2] | (layout.codes[code][1::2] << 4)).astype(np.uint8)
                layout.heads.append((pos, huffman.HEADER.pack(huffman.BLOCK, int(blocks[i])) + packed.tobytes()))
                layout.huff.append((i, j, pos + _HUFFMAN_HEAD + 4 * int(blocks[i]), code, int(bits[i, j])))
            pos += int(stored[i, j])
        if tail:
            layout.raw[(i, -1)] = pos
        layout.nbytes += size
    return layout


def _download(batch: list[Chunk], layout: Layout, out: torch.Tensor) -> list[Any]:
    """Queue the copy of each record's frames of the batch into its ``dest`` (one copy per record, on a
    copy stream, so the next batch's kernels run meanwhile), note the frames, and return them for
    :func:`_fill_crcs` with the event the copy ends at."""
    runs: list[tuple[DeviceRecord, int, int, int]] = []  # record, start in out, end in out, start in dest
    landed: list[Any] = []
    for c, (at, size) in zip(batch, layout.frames):
        r = c.record
        if at < 0 or r.frames is None:
            continue
        dest_at = r.frames[-1][0] + r.frames[-1][1] if r.frames else 0
        r.frames.append((dest_at, size, c.nbytes))
        landed.append((r.dest, dest_at, size))
        if runs and runs[-1][0] is r and runs[-1][2] == at:
            runs[-1] = (r, runs[-1][1], at + size, runs[-1][3])
        else:
            runs.append((r, at, at + size, dest_at))
    event = None
    if out.is_cuda:
        copies = stream_for(out.device, "copies")
        copies.wait_stream(torch.cuda.current_stream(out.device))
        out.record_stream(copies)
        with torch.cuda.stream(copies):
            for r, a, b, d in runs:
                torch.from_numpy(r.dest[d : d + b - a]).copy_(out[a:b], non_blocking=True)
            event = torch.cuda.Event(blocking=True)  # the checksumming threads sleep until it
            event.record(copies)
    else:
        for r, a, b, d in runs:
            r.dest[d : d + b - a] = out[a:b].numpy()
    return [(dest, at, size, event) for dest, at, size in landed]


def _fill_crcs(landed: list[Any], executor: Any) -> list[Any]:
    """Each frame's chunk CRC-32 (of its bytes after the plane table) into its header, once its copy
    landed: on ``executor`` (futures returned), else here."""
    def one(job: tuple[np.ndarray, int, int, Any]) -> None:
        dest, at, size, event = job
        if event is not None:
            event.synchronize()
        skip = _PREFIX + PLANE.size * int(dest[at + FRAME_HEADER.size + 1])  # after the chunk's plane table
        struct.pack_into("<I", dest, at + _CRC_AT, crc32(dest[at + skip : at + size]))

    if executor is None:
        for job in landed:
            one(job)
        return []
    return [executor.submit(one, job) for job in landed]


__all__ = ["BATCH_BYTES", "WORK_BYTES", "DeviceEncodeError", "DeviceRecord", "available", "chunk_bounds", "encode_records"]
