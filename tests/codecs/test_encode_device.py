"""The planes encoder of device staging (``codecs.encode_device``) run with its host kernels: its frames
decode to the native bytes with the CPU decoder, are the size the host encoder's are, and a plane whose
codes do not end where the counts said is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from checkpointd.codecs import encode_device
from checkpointd.codecs.planes import decode_chunk_into, encode_chunk


def _record(t: torch.Tensor, room: int = 0) -> encode_device.DeviceRecord:
    data = t.reshape(-1).view(torch.uint8).clone()
    return encode_device.DeviceRecord(data, t.element_size(), np.zeros(data.numel() + room, np.uint8))


def _records() -> list[encode_device.DeviceRecord]:
    g = torch.Generator().manual_seed(0)
    return [
        _record(torch.randn(1_000_001, generator=g) * 0.02),
        _record((torch.randn(300_003, generator=g) * 0.02).to(torch.bfloat16)),
        _record(torch.randn(20_000, generator=g, dtype=torch.float64)),
        _record(torch.randn(3 * 4096, generator=g).to(torch.float16)),
        _record(torch.zeros(50_000)),
    ]


def _decoded(r: encode_device.DeviceRecord, chunk_bytes: int) -> np.ndarray:
    out = np.zeros(r.data.numel(), np.uint8)
    assert r.frames is not None
    bounds = encode_device.chunk_bounds(r.data.numel(), chunk_bytes)
    assert len(r.frames) == len(bounds)
    for (at, size, native), (a, b) in zip(r.frames, bounds):
        assert native == b - a
        decode_chunk_into(memoryview(r.dest[at : at + size]), out[a:b])
    return out


@pytest.mark.parametrize("chunk_bytes", [1 << 20, 4 << 20])
def test_frames_decode_to_the_native_bytes_and_match_the_host_encoders_size(chunk_bytes) -> None:
    records = _records()
    encode_device.encode_records(records, chunk_bytes)
    for r in records:
        native = r.data.numpy()
        assert np.array_equal(_decoded(r, chunk_bytes), native)
        host = 0
        for a, b in encode_device.chunk_bounds(native.size, chunk_bytes):
            host += sum(memoryview(p).nbytes for p in encode_chunk(memoryview(native[a:b]), r.itemsize, 1))
        if r.data.numel() > 100_000 and r.data[:4].any():  # zeros: the host encoder picks zstd
            # one code per plane for a record's chunks (the host codes each chunk on its own)
            assert host <= sum(size for _, size, _ in r.frames) <= host * 1.002


def test_records_spanning_batches_keep_their_order(monkeypatch) -> None:
    monkeypatch.setattr(encode_device, "BATCH_BYTES", 1 << 20)
    records = _records()
    encode_device.encode_records(records, 1 << 19)
    for r in records:
        assert len(r.frames) > 1 or r.data.numel() <= 1 << 19
        assert np.array_equal(_decoded(r, 1 << 19), r.data.numpy())


def test_a_record_whose_frames_do_not_fit_its_host_bytes_is_left_to_the_caller() -> None:
    tiny = _record(torch.randn(5))
    noise = _record(torch.randint(-2**31, 2**31 - 1, (40_000,), dtype=torch.int32).view(torch.float32))
    kept = _record(torch.randn(40_000) * 0.02)
    encode_device.encode_records([tiny, noise, kept], 1 << 20)
    assert tiny.frames is None  # 20 bytes: a frame's headers alone are more
    assert noise.frames is None  # every plane random: stored raw, plus headers
    assert np.array_equal(_decoded(kept, 1 << 20), kept.data.numpy())


def test_the_chunk_crc_covers_every_stored_plane_byte() -> None:
    r = _record(torch.randn(100_000) * 0.02)
    encode_device.encode_records([r], 1 << 20)
    at, size, native = r.frames[0]
    r.dest[at + size - 1] ^= 1
    with pytest.raises(Exception, match="CRC-32"):
        decode_chunk_into(memoryview(r.dest[at : at + size]), np.zeros(native, np.uint8))


def test_codes_that_do_not_end_where_the_counts_say_refuse_the_batch(monkeypatch) -> None:
    lay_out = encode_device._lay_out

    def off_by_one(batch, counts):
        layout = lay_out(batch, counts)
        i, j, at, lengths, bits = layout.huff[0]
        layout.huff[0] = (i, j, at, lengths, bits - 1)
        return layout

    monkeypatch.setattr(encode_device, "_lay_out", off_by_one)
    r = _record(torch.randn(100_000) * 0.02)
    with pytest.raises(encode_device.DeviceEncodeError, match="source changed"):
        encode_device.encode_records([r], 1 << 20)
    assert r.frames is None


def test_bad_records_are_refused() -> None:
    t = torch.randn(1000)
    with pytest.raises(ValueError, match="contiguous uint8"):
        encode_device.encode_records([encode_device.DeviceRecord(t, 4, np.zeros(4000, np.uint8))], 1 << 20)
    with pytest.raises(ValueError, match="element size 3"):
        encode_device.encode_records([encode_device.DeviceRecord(t.view(torch.uint8), 3, np.zeros(4000, np.uint8))],
                                     1 << 20)


def test_chunk_bounds_are_the_chunked_encoders() -> None:
    from checkpointd.codecs.chunked import _split

    for nbytes in (1, 16, 1000, (4 << 20) + 16, 10 * (4 << 20) - 48):
        pieces = [p.nbytes for p in _split(memoryview(bytes(nbytes)), 4 << 20)]
        assert [b - a for a, b in encode_device.chunk_bounds(nbytes, 4 << 20)] == pieces
