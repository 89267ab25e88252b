"""Frame buffers: a buffer is handed out again only once nothing references its frame; planes frames built in
reused buffers decode bit for bit, whichever planes are coded and moved."""

from __future__ import annotations

import gc
import io
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from checkpointd.codecs import chunked
from checkpointd.codecs import planes as codecs_planes
from checkpointd.codecs.compress import ZstdPlanesCodec, decode_bytes
from checkpointd.codecs.frame_buffers import MIN_BYTES, FrameBuffers


def test_a_buffer_comes_back_only_when_its_views_are_gone_and_only_while_an_encoder_is_open() -> None:
    pool = FrameBuffers(keep=2)

    class Encoder:
        pass

    encoder = Encoder()
    lease = pool.open(encoder)
    first = pool.take(MIN_BYTES + 1000)
    address = first.ctypes.data
    view = memoryview(first)[:10]
    del first
    gc.collect()
    assert pool.waiting() == 0  # the memoryview still holds the frame
    second = pool.take(MIN_BYTES + 1000)
    assert second.ctypes.data != address
    del view
    assert pool.waiting() == 1
    third = pool.take(MIN_BYTES + 5000)  # a size close enough takes the waiting buffer
    assert third.ctypes.data == address and third.nbytes == MIN_BYTES + 5000
    assert pool.take(MIN_BYTES // 2 + 1).nbytes == MIN_BYTES // 2 + 1  # (a small one comes fresh)
    del second, third
    assert pool.waiting() == 2
    lease()  # the last encoder closes: nothing waits any more, and nothing given back afterwards is kept
    assert pool.waiting() == 0
    fourth = pool.take(MIN_BYTES)
    del fourth
    assert pool.waiting() == 0


def test_an_encoder_collected_without_closing_counts_out() -> None:
    pool = FrameBuffers()

    class Encoder:
        pass

    encoder = Encoder()
    pool.open(encoder)
    frame = pool.take(MIN_BYTES)
    del frame
    assert pool.waiting() == 1
    del encoder
    gc.collect()
    assert pool.waiting() == 0


def _bf16_like(numel: int, seed: int) -> np.ndarray:
    """fp32 values whose low 16 bits are zero: plane 0 (sign and low byte) and plane 3 compress, 1 and 2
    stay raw and move up behind the coded plane 0."""
    values = torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * 0.02
    return values.to(torch.bfloat16).to(torch.float32).numpy()


@pytest.mark.parametrize("worth", [[True, False, False, True], [True, True, True, True], [False, True, False, True]])
def test_planes_moved_behind_a_coded_plane_decode_bit_exact(worth: list[bool]) -> None:
    raw = _bf16_like(300_001, 1).tobytes() + b"\x01\x02\x03"
    parts = codecs_planes.encode_planes(memoryview(raw), 4, worth)
    body = b"".join(bytes(p) for p in parts)
    modes = [codecs_planes.PLANE.unpack_from(body, codecs_planes.CHUNK_HEADER.size + j * codecs_planes.PLANE.size)[0]
             for j in range(4)]
    assert modes[0] == (codecs_planes.MODE_HUFFMAN if worth[0] else codecs_planes.MODE_RAW)
    assert modes[3] == codecs_planes.MODE_HUFFMAN
    frame = codecs_planes.FRAME_HEADER.pack(codecs_planes.SKIPPABLE_CHUNK_MAGIC, len(body)) + body
    decoded = np.zeros(len(raw), dtype=np.uint8)
    codecs_planes.decode_chunk_into(memoryview(frame), decoded)
    assert decoded.tobytes() == raw


class _KeepingSink:
    """Keeps the views it is given (no copy) until the end, as a sink that writes late would."""

    def __init__(self) -> None:
        self.views: list[memoryview] = []

    def write(self, data: memoryview) -> int:
        self.views.append(data)
        return data.nbytes


@pytest.mark.parametrize("keep_views", [False, True])
def test_a_file_encoded_in_reused_buffers_decodes_bit_exact(keep_views: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Many chunks on 4 threads with few in flight: buffers are reused while the file is encoded (a sink
    that copies at once), and never while a sink still holds a frame (one that keeps the views)."""
    pool = FrameBuffers()  # this test's own: encoders that other tests left open do not count here
    monkeypatch.setattr(chunked, "FRAME_BUFFERS", pool)
    monkeypatch.setattr(codecs_planes, "FRAME_BUFFERS", pool)
    native = b"".join(_bf16_like(1 << 20, seed).tobytes() for seed in range(6))  # 24 MiB, 12 chunks
    codec = ZstdPlanesCodec(chunk_bytes=2 << 20, executor=ThreadPoolExecutor(4), max_inflight=2)
    out = _KeepingSink() if keep_views else io.BytesIO()
    taken: list[int] = []
    take = pool.take

    def counting_take(nbytes: int) -> np.ndarray:
        buf = take(nbytes)
        taken.append(buf.ctypes.data)
        return buf

    monkeypatch.setattr(pool, "take", counting_take)
    encoder = codec.encoder(out)
    encoder.dtype_hint = torch.float32
    encoder.write(memoryview(native))
    encoder.close()
    stored = b"".join(bytes(v) for v in out.views) if keep_views else out.getvalue()
    assert decode_bytes("zstd-planes", stored) == native
    assert len(taken) == 12
    if keep_views:
        assert len(set(taken)) == 12  # no buffer was handed out while the sink held its frame
    else:
        assert len(set(taken)) < 12  # buffers were handed out again
    del out, encoder
    gc.collect()
    assert pool.waiting() == 0  # the encoder closed: none kept
