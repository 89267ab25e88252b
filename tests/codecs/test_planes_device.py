"""The device decoder of ``zstd-planes`` files (``codecs.planes_device``), run on the CPU as its "device".

It must give the host decoder's bytes for every chunk kind and plane mode, refuse what the host decoder
refuses, and leave the host copy of its planes chunks unwritten (``device_only``). The CUDA run of the
same code: ``tests/gpu/test_planes_on_device_cuda.py``.
"""

from __future__ import annotations

import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from checkpointd.codecs import container, plane_kernels
from checkpointd.codecs import planes as kernels
from checkpointd.codecs.compress import decode_bytes
from checkpointd.codecs.planes_device import decode_on_device
from checkpointd.errors import CorruptCheckpointError

from planes_files import plane_compressor, planes_file

POOL = ThreadPoolExecutor(2)


def _decode(stored: bytes):
    return decode_on_device(memoryview(stored), torch.frombuffer(bytearray(stored), dtype=torch.uint8), POOL)


def _as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


@pytest.mark.parametrize("legacy", [False, True], ids=["huffman planes", "earlier releases' planes"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.complex64])
def test_device_decoding_gives_the_host_decoders_bytes(dtype, legacy) -> None:
    native, stored = planes_file(dtype, 700_001, legacy=legacy)
    assert bytes(decode_bytes("zstd-planes", stored)) == native
    out = _decode(stored)
    assert torch.equal(out.data, _as_tensor(native))
    assert out.device_only and all(0 <= a < b <= len(native) for a, b in out.device_only)
    written = torch.ones(len(native), dtype=torch.bool)
    for a, b in out.device_only:
        written[a:b] = False
    assert torch.equal(out.host[written], _as_tensor(native)[written])  # the host has every other chunk
    assert not written[len(b"PK-header-like" * 7) + 10]  # the float record is a planes chunk: device only


def _file(frames: list[tuple[bytes, int]]) -> bytes:
    """A planes container of ``(frame, native size)``, with its seek table."""
    table = container.seek_table([(len(f), n) for f, n in frames], container.PLANES_FOOTER_MAGIC)
    return b"".join(f for f, _ in frames) + table


def _planes_frame(itemsize: int, stored: list[tuple[int, bytes]], native: int, crc: int | None = None) -> bytes:
    blobs = b"".join(blob for _, blob in stored)
    table = b"".join(kernels.PLANE.pack(mode, len(blob)) for mode, blob in stored)
    flags = kernels.FLAG_ROTATED | kernels.FLAG_CRC_ALL
    header = kernels.CHUNK_HEADER.pack(kernels.KIND_PLANES, itemsize, flags, native,
                                        zlib.crc32(blobs) if crc is None else crc)
    body = header + table + blobs
    return container.FRAME_HEADER.pack(kernels.SKIPPABLE_CHUNK_MAGIC, len(body)) + body


def _nibble_file(claimed: int, escapes: int) -> tuple[bytes, bytes]:
    """2-byte elements whose high plane is nibble-coded with ``escapes`` escapes, ``claimed`` in its header."""
    count, base = 4099, 100
    rng = np.random.default_rng(escapes)
    lo = rng.integers(0, 256, count, dtype=np.uint8)
    hi = (base + rng.integers(0, 15, count)).astype(np.uint8)
    hi[rng.choice(count, escapes, replace=False)] = 7
    codes = np.where(hi == 7, 15, hi - base).astype(np.uint8)
    half = (count + 1) // 2
    padded = np.concatenate([codes, np.zeros(2 * half - count, np.uint8)])
    values = np.resize(hi[codes == 15] if escapes else np.array([7], np.uint8), claimed)
    packed = (padded[:half] * 16 + padded[half:]).astype(np.uint8).tobytes() + values.tobytes()
    nibbles = plane_kernels.NIBBLES.pack(base, claimed) + plane_compressor().compress(packed)
    native = np.zeros(2 * count, dtype=np.uint8)
    plane_kernels.from_planes([lo, hi], native)
    frame = _planes_frame(2, [(kernels.MODE_RAW, lo.tobytes()), (kernels.MODE_NIBBLES, nibbles)], 2 * count)
    return native.tobytes(), _file([(frame, 2 * count)])


@pytest.mark.parametrize("escapes", [0, 1, 40])
def test_nibble_escapes_are_put_back_in_order(escapes) -> None:
    native, stored = _nibble_file(escapes, escapes)
    assert bytes(decode_bytes("zstd-planes", stored)) == native
    assert torch.equal(_decode(stored).data, _as_tensor(native))


@pytest.mark.parametrize("escapes, claimed", [(5, 4), (5, 6), (1, 2)])
def test_a_wrong_escape_count_is_corruption_on_both_decoders(escapes, claimed) -> None:
    _, stored = _nibble_file(claimed, escapes)
    with pytest.raises(CorruptCheckpointError, match="escape"):
        decode_bytes("zstd-planes", stored)
    with pytest.raises(CorruptCheckpointError, match="escape"):
        _decode(stored)


def test_more_escapes_than_values_are_refused_before_any_decoding() -> None:
    count = 64
    nibbles = plane_kernels.NIBBLES.pack(0, count + 1) + plane_compressor().compress(bytes(count))
    frame = _planes_frame(2, [(kernels.MODE_RAW, bytes(count)), (kernels.MODE_NIBBLES, nibbles)], 2 * count)
    with pytest.raises(CorruptCheckpointError, match="escapes"):
        _decode(_file([(frame, 2 * count)]))


def test_a_plane_table_past_the_chunk_and_a_raw_plane_of_the_wrong_size_are_refused() -> None:
    count = 256
    frame = bytearray(_planes_frame(2, [(kernels.MODE_RAW, bytes(count)), (kernels.MODE_RAW, bytes(count))], 2 * count))
    at = container.FRAME_HEADER.size + kernels.CHUNK_HEADER.size + kernels.PLANE.size  # plane 1's entry
    frame[at : at + kernels.PLANE.size] = kernels.PLANE.pack(kernels.MODE_ZSTD, 1 << 30)
    with pytest.raises(CorruptCheckpointError, match="bad plane 1"):
        _decode(_file([(bytes(frame), 2 * count)]))
    short = _planes_frame(2, [(kernels.MODE_RAW, bytes(count - 1)), (kernels.MODE_RAW, bytes(count + 1))], 2 * count)
    with pytest.raises(CorruptCheckpointError, match="bad plane 0"):
        _decode(_file([(short, 2 * count)]))


def test_a_changed_stored_byte_fails_the_chunk_crc_unless_the_file_was_checked_whole() -> None:
    native, stored = planes_file(torch.float32, 100_000)
    broken = bytearray(stored)
    broken[len(b"PK-header-like") + 40_000] ^= 0x10  # inside the first float record's raw (mantissa) planes
    for decode in (lambda s: decode_bytes("zstd-planes", s), _decode):
        with pytest.raises(CorruptCheckpointError, match="CRC"):
            decode(bytes(broken))
    # a restore checks the file's checksum first (every byte): the chunks' CRCs are not computed again
    unchecked = decode_on_device(memoryview(bytes(broken)), _as_tensor(bytes(broken)), POOL, check_chunks=False)
    assert not torch.equal(unchecked.data, _as_tensor(native))  # the changed byte, decoded as stored
    assert (unchecked.data != _as_tensor(native)).sum() == 1


@pytest.mark.parametrize("extra", [-1, 1])
def test_a_zstd_plane_of_the_wrong_size_is_corrupt(extra) -> None:
    count = 1000
    plane = bytes(range(256)) * 4
    wrong = plane_compressor().compress(plane[: count + extra])
    frame = _planes_frame(2, [(kernels.MODE_RAW, plane[:count]), (kernels.MODE_ZSTD, wrong)], 2 * count)
    with pytest.raises(CorruptCheckpointError, match="decodes to"):
        _decode(_file([(frame, 2 * count)]))


def test_a_truncated_file_has_no_seek_table() -> None:
    _, stored = planes_file(torch.bfloat16, 50_000)
    with pytest.raises(CorruptCheckpointError, match="seek table"):
        _decode(stored[:-3])


@pytest.mark.parametrize("end", [0xFFFFFFFF, 0])
def test_block_ends_are_taken_from_the_device_copy_and_kept_within_their_plane(end) -> None:
    """The blocks' ends come from the bytes on the device (the checksummed ones), clamped to their
    plane's stream: a device copy whose end differs from the host's (too far, or before its start)
    does not decode, and nothing is read past the plane."""
    from checkpointd.codecs import huffman
    from checkpointd.codecs.container import PLANES_FOOTER_MAGIC, ViewFile, read_index
    from checkpointd.codecs.planes_device import _plan

    _, stored = planes_file(torch.float32, 100_000)
    frames, natives = read_index(ViewFile(memoryview(stored)), PLANES_FOOTER_MAGIC, "zstd-planes")
    chunks, _, _ = _plan(memoryview(stored), frames, natives, True)
    plane = next(p for c in chunks for p in c.on_device.values() if p.plane.ends.size > 2)
    forged = bytearray(stored)
    at = plane.src + huffman.HEADER.size + huffman.LENGTHS_NBYTES + 4  # block 1's end
    forged[at : at + 4] = end.to_bytes(4, "little")
    with pytest.raises(CorruptCheckpointError, match="Huffman plane"):
        decode_on_device(memoryview(stored), _as_tensor(bytes(forged)), POOL, check_chunks=False)
    assert torch.equal(_decode(stored).data[:10], _as_tensor(decode_bytes("zstd-planes", stored)[:10]))


def test_the_rows_the_kernel_makes_are_each_planes_block_table() -> None:
    """``huffman_device.block_rows`` (what the CUDA kernel computes for its block, on the host) gives every
    plane's ``huffman.block_table`` rows, moved to its place in the decode buffer and its decode table."""
    from checkpointd.codecs import huffman, huffman_device
    from checkpointd.codecs.container import PLANES_FOOTER_MAGIC, ViewFile, read_index
    from checkpointd.codecs.planes_device import _plan

    _, stored = planes_file(torch.bfloat16, 200_001)
    frames, natives = read_index(ViewFile(memoryview(stored)), PLANES_FOOTER_MAGIC, "zstd-planes")
    planes = [p for c in _plan(memoryview(stored), frames, natives, True)[0] for p in c.on_device.values()]
    assert len(planes) >= 2
    per_plane, _ = huffman_device.plane_tables(planes)
    rows = huffman_device.block_rows(np.frombuffer(stored, dtype=np.uint8), per_plane)
    expected = []
    for p, (_, blocks, _, _, _, _, _, table, first) in zip(planes, per_plane.tolist()):
        own, _ = huffman.block_table(p.plane, p.count)
        assert first == sum(len(e) for e in expected) and blocks == len(own)
        own[:, :2] += 8 * p.src
        own[:, 2] += p.dst
        own[:, 3] |= table << 32
        expected.append(own)
    assert np.array_equal(rows, np.concatenate(expected))


def test_the_merge_kernel_is_given_only_ranges_inside_its_tensors() -> None:
    """``merge_device.merge`` checks every plane and output range on the host, before any launch."""
    from checkpointd.codecs import merge_device

    out, sources = torch.zeros(40, dtype=torch.uint8), [torch.zeros(30, dtype=torch.uint8)]
    bad = [merge_device.Chunk(0, 10, [(0, 21), (0, 0)], False),  # a plane past its source
           merge_device.Chunk(21, 10, [(0, 0), (0, 0)], False),  # elements past the output
           merge_device.Chunk(0, 10, [(1, 0), (0, 0)], False),  # no such source
           merge_device.Chunk(0, 10, [(0, 0)] * 3, False),  # three planes
           merge_device.Chunk(-1, 10, [(0, 0), (0, 0)], False)]
    for chunk in bad:
        with pytest.raises(ValueError, match="merge"):
            merge_device.merge(out, sources, [chunk])
    with pytest.raises(ValueError, match="contiguous 1-D uint8"):
        merge_device.merge(out.view(torch.int32), sources, [])


def _run_merge_table(table, sources: list[np.ndarray], out: np.ndarray) -> np.ndarray:
    """What the CUDA merge kernel does with ``table`` (``merge_device.Table``), on the host; returns how many
    times each output byte was written."""
    written = np.zeros(out.size, dtype=np.int64)
    for row, where in zip(table.rows.tolist(), table.source_of.tolist()):
        at, count, size, rotated = row[1], row[2], row[3] & 255, bool(row[3] >> 8)
        planes = [sources[where[j]][row[4 + j] : row[4 + j] + count] for j in range(size)]
        assert all(p.size == count for p in planes) and at + count * size <= out.size
        if size == 1:
            out[at : at + count] = planes[0]
        else:
            plane_kernels.from_planes(planes, out[at : at + count * size], rotated)
        written[at : at + count * size] += 1
    return written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_prepared_merge_table_writes_every_native_byte_once(dtype) -> None:
    """The merge kernel's table a restore prepares during the upload (every staged chunk copied from the
    landing, every planes chunk merged from the stored file, the host-decoded and the device-decoded
    planes, every tail copied) gives, run on the host as the kernel runs it, the file's native bytes,
    each written exactly once."""
    from checkpointd.codecs import huffman_device, merge_device, planes_device

    native, stored = planes_file(dtype, 300_007)
    p = planes_device.prepare(memoryview(stored), torch.device("cpu"), POOL, True)
    device_planes = torch.zeros(p.on_device_nbytes, dtype=torch.uint8)
    bad = torch.zeros((), dtype=torch.bool)
    huffman_device.decode(_as_tensor(stored), device_planes, p.huffman, bad, p.huffman_tables)
    assert not bool(bad) and p.huffman  # the coded planes decoded on the "device"
    landing = np.concatenate([t.numpy() for t in p.sources])  # what goes up staged, in one copy
    sizes = [len(stored), p.decoded_nbytes, p.on_device_nbytes, landing.size]
    table = merge_device.table(planes_device._staged_copies(p.chunks, p.decoded_nbytes)
                               + planes_device._fused_chunks(p.chunks), len(native), sizes)
    sources = [np.frombuffer(stored, dtype=np.uint8), landing[: p.decoded_nbytes], device_planes.numpy(), landing]
    out = np.zeros(len(native), dtype=np.uint8)
    written = _run_merge_table(table, sources, out)
    assert out.tobytes() == native
    assert (written == 1).all()
    with pytest.raises(ValueError, match="merge: a table for an output"):  # tensors of other sizes are refused
        merge_device.launch(table, torch.zeros(len(native) + 1, dtype=torch.uint8),
                            [torch.zeros(n, dtype=torch.uint8) for n in sizes])
