"""The planes encoder's CUDA kernels (``codecs.encode_device``): the same frames, byte for byte, as its
host kernels, and codes that do not end where the counts say refuse the batch. Skipped without CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from checkpointd.codecs import encode_device

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(3_000_001, generator=g) * 0.02,
        (torch.randn(1_000_003, generator=g) * 0.02).to(torch.bfloat16),
        torch.randn(70_001, generator=g, dtype=torch.float64),
        torch.randn(5 * 4096, generator=g).to(torch.float16),
        torch.randn(7, generator=g),
        torch.zeros(50_000),
        torch.randint(-2**31, 2**31 - 1, (60_000,), dtype=torch.int32, generator=g).view(torch.float32),
    ]


def _encode(tensors: list[torch.Tensor], device: str, chunk_bytes: int) -> list[encode_device.DeviceRecord]:
    records = [encode_device.DeviceRecord(t.reshape(-1).view(torch.uint8).to(device), t.element_size(),
                                          np.zeros(t.numel() * t.element_size(), np.uint8)) for t in tensors]
    encode_device.encode_records(records, chunk_bytes)
    return records


@pytest.mark.parametrize("batch_bytes", [1 << 20, 256 << 20])
def test_cuda_frames_are_the_host_kernels_frames(monkeypatch, batch_bytes) -> None:
    monkeypatch.setattr(encode_device, "BATCH_BYTES", batch_bytes)
    tensors = _tensors()
    on_host = _encode(tensors, "cpu", 1 << 20)
    on_cuda = _encode(tensors, "cuda", 1 << 20)
    for h, c in zip(on_host, on_cuda):
        assert h.frames == c.frames
        if h.frames is not None:
            assert np.array_equal(h.dest, c.dest)
    assert sum(r.frames is None for r in on_cuda) == 2  # 7 elements, and noise: frames larger than the data


def test_cuda_codes_that_do_not_end_where_the_counts_say_refuse_the_batch(monkeypatch) -> None:
    lay_out = encode_device._lay_out

    def off(batch, counts):
        layout = lay_out(batch, counts)
        for n, (i, j, at, lengths, bits) in enumerate(layout.huff):
            layout.huff[n] = (i, j, at, lengths, bits + (1 if n % 2 else -1))
        return layout

    monkeypatch.setattr(encode_device, "_lay_out", off)
    with pytest.raises(encode_device.DeviceEncodeError, match="source changed"):
        _encode([torch.randn(1_000_000) * 0.02], "cuda", 1 << 20)
