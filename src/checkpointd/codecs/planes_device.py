"""Decode a ``zstd-planes`` file onto a torch device: the host checks, the device decodes and merges.

Why: decoding a planes file on the host ends in the byte-plane merge, a pass over every native byte,
and then the merged bytes still cross to the GPU. Here the stored file is already on the device (the
restore uploaded it there to checksum it, :mod:`checkpointd.restore.device_decode`), so its planes never
leave it. The host checks every chunk's layout and every Huffman plane's header, lengths and block
ends, decodes the chunks that are not planes (zip headers, pickles, integer tensors) and uploads those
few bytes in one queued copy; on the device the Huffman blocks are decoded
(:mod:`checkpointd.codecs.huffman_device`) and one kernel (:mod:`checkpointd.codecs.merge_device`) reads
each chunk's planes and writes its elements, rotated back, and puts the other uploaded chunks in their
places in the same launch. Planes of earlier releases (nibble codes, zstd frames) are decoded on the
host and merged with torch operations, group by group.

The device's part is those two kernels and a few small copies up, and no torch operation: CUDA loads a
torch operation's kernels on its first launch in a process, and a resumed job's restore is the first
(H200, 4.83 GB: the block table made with a dozen torch operations put 0.26 s of loading into that
restore, which took 0.47 s against 0.21 s uncompressed; ``checkpointd_cold_planes`` in
``benchmarks/bench_restore.py``).

Nothing here waits for the device until :meth:`OnDevice.check`: a restore parses the file's host bytes
meanwhile. Both parts (:func:`prepare` on the host, :func:`decode_on_device`) read only the stored
bytes, so a restore begins them before the file's checksum is known and uses what they give only once
it matched (:mod:`checkpointd.restore.device_decode`).

nvCOMP or any other device entropy decoder is not used: checkpoint bytes are untrusted, and nvCOMP's
zstd and deflate decoders are documented to take valid input only. Every index and size is checked on
the host (:func:`checkpointd.codecs.planes.read_chunk_layout`) before the device sees it, device
indexing is clamped so that no input can address outside its tensors, and what only the device can
check (that every Huffman block decodes to exactly its symbols, the escapes of a nibble plane) is
gathered in one flag, read once by :meth:`OnDevice.check`.

The result is exact: the same bytes as :func:`checkpointd.codecs.planes.decode_chunk_into` gives for every
chunk, with the same refusals. The host copy of the native bytes (:attr:`OnDevice.host`) holds only the
chunks decoded on the host; the ranges of the planes chunks (:attr:`OnDevice.device_only`) are filled on
the host only on demand (:func:`checkpointd.restore.device_image.ensure_host`).
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np
import torch

from checkpointd.codecs import huffman, huffman_device, merge_device
from checkpointd.codecs.container import PLANES_FOOTER_MAGIC, ViewFile, read_index
from checkpointd.codecs.crc import crc32
from checkpointd.codecs.plane_kernels import ESCAPE, NIBBLES
from checkpointd.codecs.planes import (
    KIND_PLANES,
    KIND_RAW,
    MODE_HUFFMAN,
    MODE_NIBBLES,
    MODE_RAW,
    ChunkLayout,
    read_chunk_layout,
)
from checkpointd.codecs.zstd_frames import copy_into, zstd_decompress_into
from checkpointd.errors import CorruptCheckpointError
from checkpointd.native import cuda_rtc

QUEUED_UPLOAD_BYTES = 16 << 20
"""Host-decoded bytes up to this size go up in one queued copy (:func:`_host_bytes_up`); more (a file of
earlier releases' nibble planes) go through the caller's ``upload``."""
_WIDE = {2: torch.int16, 4: torch.int32, 8: torch.int64}
_LOW_BITS = {2: 0x7FFF, 4: 0x7FFFFFFF, 8: 0x7FFFFFFFFFFFFFFF}


@dataclass
class OnDevice:
    """A decoded file: its native bytes on the device, and on the host outside ``device_only``."""

    host: torch.Tensor
    data: torch.Tensor
    device_only: list[tuple[int, int]] = field(default_factory=list)
    """Native byte ranges ``[start, stop)`` whose host bytes were not written (merged on the device only)."""
    bad: torch.Tensor | None = None
    """The device's damage flag, not read yet (:meth:`check`)."""
    done: torch.cuda.Event | None = None
    """Recorded after the decoding's last kernel, on the stream it was queued on (a CUDA device)."""

    def check(self) -> None:
        """Wait for the device's decoding; raise if it found the file damaged. Call before reading ``data``
        (on any stream: the decoding has finished on return).

        Raises:
            CorruptCheckpointError: a Huffman plane that does not decode, a nibble plane whose escapes differ.
        """
        done, self.done = self.done, None
        if done is not None:
            done.synchronize()
        bad, self.bad = self.bad, None
        if bad is not None and bool(bad.item()):
            raise CorruptCheckpointError("a Huffman plane of the 'zstd-planes' file does not decode to its symbols, "
                                         "or a nibble plane has a different number of escape codes than its header "
                                         "says; the file is corrupt, restore another step")


@dataclass
class _Chunk:
    index: int
    frame: int
    native: tuple[int, int]
    layout: ChunkLayout
    decoded: list[tuple[int, int, int, int]]
    """Per plane: ``(start, stop)`` of its host-decoded bytes in the upload buffer (empty: stored raw or
    decoded on the device), and for a nibble plane its base and escape count (else zeros)."""
    on_device: dict[int, huffman.PlaneAt] = field(default_factory=dict)
    """Planes decoded on the device, by plane index (their bytes: :attr:`~checkpointd.codecs.huffman.PlaneAt.dst` in the
    device's decode buffer)."""

    def group(self) -> tuple:
        """Chunks of one group are merged together: the same element size, count and plane modes."""
        lay = self.layout
        return lay.itemsize, lay.count, lay.rotated, tuple(mode for mode, _, _ in lay.planes), tuple(self.on_device)


@dataclass
class Prepared:
    """The host's part of decoding a file (:func:`prepare`), made before the device's part."""

    chunks: list[_Chunk]
    host: torch.Tensor
    """The native bytes the host decoded, at their places in the native file (the rest not written)."""
    sources: list[torch.Tensor]
    """What goes up to the device: the host-decoded planes (one buffer), then each chunk that is not
    planes, in chunk order (:func:`decode_on_device` puts each in its place)."""
    staged: torch.Tensor | None
    """``sources`` gathered into one buffer for one queued copy up, if they fit in :data:`QUEUED_UPLOAD_BYTES`
    and the device is a GPU, else None."""
    decoded_nbytes: int
    on_device_nbytes: int
    huffman: list[huffman.PlaneAt]
    """The Huffman planes the device decodes, and the host's tables for that (:func:`huffman_device.plane_tables`)."""
    huffman_tables: huffman_device.PlaneTables | None
    merge: merge_device.Table | None = None
    """Where the merge kernel runs (else None: torch operations merge): every merge and tail copy of the
    chunks without nibble planes and, staged, every copy of the other chunks from the landing, checked and
    laid out beforehand (the device's part then only fills in addresses)."""


def prepare(stored: memoryview, device: torch.device, executor: Executor, check_chunks: bool = True) -> Prepared:
    """The host's part of decoding the ``zstd-planes`` file ``stored`` onto ``device``: every chunk's
    layout checked, the chunks that are not planes (and planes the device does not decode) decoded on
    the host, the bytes to upload gathered. It reads only ``stored``, so a restore runs it while the
    file's upload and checksum are still under way (:mod:`checkpointd.restore.device_decode`);
    its result is used only once the file matched its checksum. ``executor`` runs the host decoding,
    one chunk per task; ``check_chunks`` as in :func:`decode_on_device`.

    Raises:
        CorruptCheckpointError: a damaged or malformed file.
    """
    frames, natives = read_index(ViewFile(stored), PLANES_FOOTER_MAGIC, "zstd-planes")
    chunks, decoded_nbytes, on_device_nbytes = _plan(stored, frames, natives, huffman_device.available(device))
    host = torch.empty(natives[-1], dtype=torch.uint8)
    scratch = torch.empty(decoded_nbytes, dtype=torch.uint8)
    host_np, scratch_np = host.numpy(), scratch.numpy()
    tasks = [executor.submit(_host_work, stored, c, host_np, scratch_np, check_chunks) for c in chunks
             if _has_host_work(c, check_chunks)]
    errors = [t.exception() for t in tasks]
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    sources = ([scratch] if decoded_nbytes else []) + [host[c.native[0] : c.native[1]] for c in chunks
                                                        if c.layout.kind != KIND_PLANES]
    staged = None
    if device.type == "cuda" and sources and sum(t.numel() for t in sources) <= QUEUED_UPLOAD_BYTES:
        # numpy, not torch.cat: torch's CPU kernel spreads it over its intra-op threads, which wait for cores
        # behind the upload's copy threads (1.8 MB took 10-220 ms beside an upload on an H200 host)
        staged = torch.from_numpy(np.concatenate([t.numpy() for t in sources]))
    on_device = [q for c in chunks for q in c.on_device.values()]
    merge = None
    if merge_device.available(device):  # (its kernel loaded here: a restore runs this during the file's upload)
        copies = [] if staged is None else _staged_copies(chunks, decoded_nbytes)
        merge = merge_device.table(copies + _fused_chunks(chunks), natives[-1], [stored.nbytes, decoded_nbytes, on_device_nbytes]
                                   + ([] if staged is None else [staged.numel()]))
    return Prepared(chunks, host, sources, staged, decoded_nbytes, on_device_nbytes, on_device,
                    huffman_device.plane_tables(on_device) if on_device else None, merge)


def decode_on_device(stored: memoryview, stored_data: torch.Tensor, executor: Executor,
                     upload: Callable[[list[tuple[torch.Tensor, torch.Tensor]]], None] | None = None,
                     check_chunks: bool = True, data: torch.Tensor | None = None, wait: bool = True,
                     prepared: Prepared | None = None, stream: torch.cuda.Stream | None = None) -> OnDevice:
    """Decode the verified ``zstd-planes`` file ``stored`` (host bytes) whose copy ``stored_data`` is on the device.

    ``executor`` runs the host work (zstd frames, chunk CRCs) one chunk per task; ``upload(pairs)``
    copies host bytes to the device, ``dst.copy_(src)`` for every ``(dst, src)`` (the default). ``check_chunks=False`` skips the
    chunks' own CRC-32s, for a file whose every byte was just checked against its manifest (they cover
    the same bytes: they exist for reads of one tensor, which check no file checksum). ``data``: where
    the native bytes go (uint8 on the device, the file's native size; default: allocated here).
    ``wait=False`` returns once the device's work is queued, the host bytes written: the caller may parse
    them meanwhile, and calls :meth:`OnDevice.check` before anything reads the device bytes.
    ``prepared``: the host's part, made from ``stored`` beforehand (:func:`prepare`), else made here.
    ``stream``: queue the device's work on this CUDA stream (after the current stream's queued work)
    rather than on the current stream; :meth:`OnDevice.check` waits for it.

    Raises:
        CorruptCheckpointError: a damaged or malformed file (nothing of it is usable then).
    """
    device = stored_data.device
    if stored_data.numel() != stored.nbytes:
        raise ValueError(f"the device copy has {stored_data.numel()} bytes, the file {stored.nbytes}")
    p = prepared if prepared is not None else prepare(stored, device, executor, check_chunks)
    native_nbytes = p.host.numel()
    if data is None:
        data = torch.empty(native_nbytes, dtype=torch.uint8, device=device)
    elif data.numel() != native_nbytes or data.device != device:
        raise ValueError(f"the output has {data.numel()} bytes on {data.device}, the file {native_nbytes} on {device}")
    bad = _zero_flag(device)
    device_planes = torch.empty(p.on_device_nbytes, dtype=torch.uint8, device=device)
    scratch = torch.empty(p.decoded_nbytes if p.staged is None else 0, dtype=torch.uint8, device=device)
    with _queued_on(stream, device, [stored_data, data, bad, device_planes, scratch]):
        scratch, landing = _host_bytes_up(p, scratch, data, upload)
        huffman_device.decode(stored_data, device_planes, p.huffman, bad, p.huffman_tables)
        sources = [stored_data, scratch, device_planes, *([] if landing is None else [landing])]
        for group in _groups(p.chunks):
            if p.merge is None or not _fusable(group):
                _merge(group, sources, data, bad)
                for a, b, at in _tail_spans(group):
                    data[a:b].copy_(stored_data[at : at + b - a])
        if p.merge is not None:
            merge_device.launch(p.merge, data, sources)
        out = OnDevice(p.host, data, _joined([c.native for c in p.chunks if c.layout.kind == KIND_PLANES]), bad)
        if device.type == "cuda":
            out.done = torch.cuda.Event()
            out.done.record(torch.cuda.current_stream(device))
    if wait:
        out.check()
    return out


@contextlib.contextmanager
def _queued_on(stream: torch.cuda.Stream | None, device: torch.device, buffers: list[torch.Tensor]) -> Iterator[None]:
    """Within the block, work is queued on ``stream`` (None: the current stream), after the current
    stream's queued work. ``buffers`` were allocated on the current stream, so that their memory goes
    back to its pool, not to a pool the training never allocates from; they are kept from reuse until
    ``stream``'s work is done with them (``record_stream``), also where the result is dropped unfinished."""
    if stream is None:
        yield
        return
    stream.wait_stream(torch.cuda.current_stream(device))
    for t in buffers:
        t.record_stream(stream)
    with torch.cuda.stream(stream):
        yield


def _zero_flag(device: torch.device) -> torch.Tensor:
    """The damage flag, False, on ``device`` (on a GPU copied up: no fill kernel to load in a fresh process)."""
    return cuda_rtc.table_to(device, torch.zeros((), dtype=torch.bool)) if device.type == "cuda" else \
        torch.zeros((), dtype=torch.bool)


def _host_bytes_up(p: Prepared, scratch: torch.Tensor, data: torch.Tensor,
                   upload: Callable[[list[tuple[torch.Tensor, torch.Tensor]]], None] | None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The host-decoded bytes on the device: ``(scratch, landing)``: the host-decoded planes there, and
    the staged bytes' landing (None: not staged), from which the merge kernel copies the other chunks
    into ``data`` (its source 3, :func:`_staged_copies` in :attr:`Prepared.merge`).

    Staged (:attr:`Prepared.staged`), they go up in one copy queued on the current stream without the
    host waiting for the device (:func:`checkpointd.native.cuda_rtc.table_to`; an upload through the
    restore's bounce waits for everything queued before it: the other files' decoding): the
    host-decoded planes stay where they landed, the other chunks are scattered to their places in
    ``data`` in the merge kernel's launch (else by torch). Otherwise into ``scratch`` and ``data``
    through ``upload`` (default: ``dst.copy_(src)`` for every pair)."""
    targets = [data[c.native[0] : c.native[1]] for c in p.chunks if c.layout.kind != KIND_PLANES]
    if p.staged is None:
        pairs = list(zip(([scratch] if p.decoded_nbytes else []) + targets, p.sources))
        if pairs:
            (upload or _copy_pairs)(pairs)
        return scratch, None
    landing = cuda_rtc.table_to(data.device, p.staged)
    if p.merge is None:
        torch._foreach_copy_(targets, list(landing[p.decoded_nbytes :].split([t.numel() for t in targets])))
    return landing[: p.decoded_nbytes], landing


def _staged_copies(chunks: list[_Chunk], decoded_nbytes: int) -> list[merge_device.Chunk]:
    """The merge kernel's copies of the staged chunks that are not planes, from the landing (source 3) to
    their places (:attr:`Prepared.sources`' order)."""
    copies, at = [], decoded_nbytes
    for c in chunks:
        if c.layout.kind != KIND_PLANES:
            copies.append(merge_device.Chunk(c.native[0], c.native[1] - c.native[0], [(3, at)], False))
            at += c.native[1] - c.native[0]
    return copies


def _groups(chunks: list[_Chunk]) -> list[list[_Chunk]]:
    """The planes chunks by :meth:`_Chunk.group`."""
    groups: dict[tuple, list[_Chunk]] = {}
    for c in chunks:
        if c.layout.kind == KIND_PLANES:
            groups.setdefault(c.group(), []).append(c)
    return list(groups.values())


def _fusable(group: list[_Chunk]) -> bool:
    """Whether the merge kernel merges the group (it has no nibble planes)."""
    return all(mode != MODE_NIBBLES for mode, _, _ in group[0].layout.planes)


def _fused_chunks(chunks: list[_Chunk]) -> list[merge_device.Chunk]:
    """What the merge kernel does for the planes chunks without nibble planes: each merged, and the bytes
    after its last whole element copied from the stored file (source 0)."""
    out = []
    for group in _groups(chunks):
        if _fusable(group):
            out += [_fused(c) for c in group]
            out += [merge_device.Chunk(a, b - a, [(0, at)], False) for a, b, at in _tail_spans(group)]
    return out


def _copy_pairs(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for dst, src in pairs:
        dst.copy_(src)


def _plan(stored: memoryview, frames: list[int], natives: list[int],
          huffman_on_device: bool) -> tuple[list[_Chunk], int, int]:
    """Every chunk's checked layout, where its host-decoded planes go in the upload buffer and where its
    device-decoded planes go in the device's decode buffer (the two buffers' sizes come last)."""
    chunks, cursor, on_device = [], 0, 0
    for i in range(len(frames) - 1):
        native = (natives[i], natives[i + 1])
        if native[0] == native[1]:
            continue  # the banner (and any empty frame): no native bytes
        frame = stored[frames[i] : frames[i + 1]]
        try:
            layout = read_chunk_layout(frame, native[1] - native[0])
            chunk = _Chunk(i, frames[i], native, layout, [])
            for j, (mode, start, stop) in enumerate(layout.planes):
                size, base, escaped = 0, 0, 0
                if mode == MODE_HUFFMAN and huffman_on_device:
                    plane = huffman.read_plane(frame[start:stop], layout.count)
                    chunk.on_device[j] = huffman.PlaneAt(frames[i] + start, plane, on_device, layout.count)
                    on_device += -(-layout.count // 16) * 16  # 16-byte aligned: the kernel stores whole words
                elif mode == MODE_NIBBLES:
                    base, escaped = NIBBLES.unpack_from(frame, start)
                    size = (layout.count + 1) // 2 + escaped
                elif mode != MODE_RAW:
                    size = layout.count
                chunk.decoded.append((cursor, cursor + size, base, escaped))
                cursor += size
        except CorruptCheckpointError as exc:
            raise _in_chunk(exc, i, frames[i]) from exc
        chunks.append(chunk)
    return chunks, cursor, on_device


def _has_host_work(c: _Chunk, check_crc: bool) -> bool:
    """Whether :func:`_host_work` has anything to do for ``c`` (not for a planes chunk decoded on the device
    whose CRC is not checked)."""
    lay = c.layout
    return lay.kind != KIND_PLANES or (check_crc and lay.crc_range is not None) or any(
        mode != MODE_RAW and j not in c.on_device for j, (mode, _, _) in enumerate(lay.planes))


def _host_work(stored: memoryview, c: _Chunk, host: np.ndarray, scratch: np.ndarray, check_crc: bool) -> None:
    """A pool task: check the chunk's CRC, decode its zstd frames (planes into ``scratch``, else into ``host``)."""
    lay = c.layout
    frame = stored[c.frame : c.frame + lay.body[1]]
    try:
        if check_crc and lay.crc_range is not None and crc32(frame[lay.crc_range[0] : lay.crc_range[1]]) != lay.crc:
            raise CorruptCheckpointError(f"CRC-32 of the stored bytes differs from the chunk's ({lay.crc:#010x})")
        a, b = c.native
        if lay.kind == KIND_RAW:
            copy_into(host[a:b], frame[lay.body[0] : lay.body[1]])
        elif lay.kind != KIND_PLANES:
            zstd_decompress_into(frame[lay.body[0] : lay.body[1]], host[a:b])
        for j, ((mode, start, stop), (lo, hi, _, _)) in enumerate(zip(lay.planes, c.decoded)):
            if mode == MODE_NIBBLES:
                zstd_decompress_into(frame[start + NIBBLES.size : stop], scratch[lo:hi])
            elif mode == MODE_HUFFMAN and j not in c.on_device:
                huffman.decode_into(frame[start:stop], scratch[lo:hi])
            elif mode != MODE_RAW and j not in c.on_device:
                zstd_decompress_into(frame[start:stop], scratch[lo:hi])
    except CorruptCheckpointError as exc:
        raise _in_chunk(exc, c.index, c.frame) from exc


def _merge(group: list[_Chunk], sources: list[torch.Tensor], out: torch.Tensor, bad: torch.Tensor) -> None:
    """The native bytes of a group of planes chunks (one :meth:`_Chunk.group`) into ``out``, on the device,
    with torch operations (nibble planes, or no merge kernel): a fixed number of device operations for the
    whole group, one copy per run of adjacent chunks. ``sources``: ``(stored, scratch, device_planes)``."""
    lay = group[0].layout
    n, size = lay.count, lay.itemsize
    if n:
        planes = []
        for j, (mode, _, _) in enumerate(lay.planes):
            if mode == MODE_NIBBLES:
                planes.append(_unpack_nibbles(sources[1], [c.decoded[j] for c in group], n, bad))
            else:
                k = _plane_at(group[0], j)[0]  # one source for the whole group (:meth:`_Chunk.group`)
                planes.append(_rows(sources[k], [(at, at + n) for at in (_plane_at(c, j)[1] for c in group)]))
        merged = torch.stack(planes, dim=2)  # (chunks, n, itemsize): element bytes, least significant first
        if lay.rotated:
            wide = merged.view(_WIDE[size])
            merged = (((wide >> 1) & _LOW_BITS[size]) | (wide << (8 * size - 1))).view(torch.uint8)
        merged = merged.reshape(len(group), n * size)
        first = 0
        for i in range(1, len(group) + 1):  # runs of chunks whose native bytes follow each other
            if i == len(group) or group[i].native[0] != group[i - 1].native[0] + n * size or group[i - 1].native[1] \
                    != group[i - 1].native[0] + n * size:
                a = group[first].native[0]
                out[a : a + (i - first) * n * size].copy_(merged[first:i].reshape(-1))
                first = i


def _plane_at(c: _Chunk, j: int) -> tuple[int, int]:
    """Where plane ``j`` (not a nibble plane) of ``c`` is: ``(source, byte offset)`` among the sources
    ``(stored, scratch, device_planes)``: stored raw, decoded on the host, decoded on the device."""
    mode, start, _ = c.layout.planes[j]
    if mode == MODE_RAW:
        return 0, c.frame + start
    if j in c.on_device:
        return 2, c.on_device[j].dst
    return 1, c.decoded[j][0]


def _fused(c: _Chunk) -> merge_device.Chunk:
    """A chunk without nibble planes for :func:`checkpointd.codecs.merge_device.merge`."""
    lay = c.layout
    return merge_device.Chunk(c.native[0], lay.count, [_plane_at(c, j) for j in range(len(lay.planes))], lay.rotated)


def _tail_spans(group: list[_Chunk]) -> list[tuple[int, int, int]]:
    """The bytes after each chunk's last whole element, stored as they are: ``(native start, native stop,
    stored start)``."""
    spans = []
    for c in group:
        t0, t1 = c.layout.tail
        if t1 > t0:
            spans.append((c.native[0] + c.layout.count * c.layout.itemsize, c.native[1], c.frame + t0))
    return spans


def _rows(source: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    """``source``'s spans of one length as the rows of one tensor."""
    if len(spans) == 1:
        return source[spans[0][0] : spans[0][1]].unsqueeze(0)
    return torch.stack([source[a:b] for a, b in spans])


def _unpack_nibbles(scratch: torch.Tensor, decoded: list[tuple[int, int, int, int]], n: int,
                    bad: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`checkpointd.codecs.plane_kernels.pack_nibbles` for a group of planes on the device.

    ``decoded``: per plane its ``(start, stop, base, escapes)`` in ``scratch`` (codes, then escapes).
    Escapes go back in element order; a plane whose number of escape codes differs from its header
    sets ``bad``. With no escapes claimed, code 15 is a value like the others (as the host decoder has it).
    """
    half = (n + 1) // 2
    packed = _rows(scratch, [(lo, lo + half) for lo, _, _, _ in decoded])
    codes = torch.cat([packed >> 4, packed & 15], dim=1)[:, :n]
    device = scratch.device
    bases = torch.tensor([base for _, _, base, _ in decoded], dtype=torch.uint8).to(device, non_blocking=True)
    plane = codes + bases[:, None]
    counts = [escaped for _, _, _, escaped in decoded]
    if not any(counts):
        return plane
    claimed = torch.tensor(counts, dtype=torch.int64).to(device, non_blocking=True)
    mask = (codes == ESCAPE) & (claimed > 0)[:, None]
    bad |= (mask.sum(dim=1) != claimed).any()
    escapes = torch.cat([scratch[lo + half : hi] for lo, hi, _, e in decoded if e])
    order = torch.cumsum(mask.reshape(-1), 0).sub_(1).clamp_(0, escapes.numel() - 1).reshape(mask.shape)
    return torch.where(mask, escapes[order], plane)


def _joined(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in ranges:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _in_chunk(exc: CorruptCheckpointError, index: int, at: int) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"'zstd-planes' chunk {index} (file byte {at}): {exc}; the file is corrupt, "
                                  f"restore another step")


__all__ = ["OnDevice", "Prepared", "decode_on_device", "prepare"]
