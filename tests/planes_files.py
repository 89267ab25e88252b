"""``zstd-planes`` files with every kind of chunk, for the decoders' tests (host and device)."""

from __future__ import annotations

import io

import torch

from checkpointd.codecs.compress import get_codec


def planes_values(dtype: torch.dtype, n: int, seed: int = 0) -> torch.Tensor:
    """Weights-like values with a few outliers (nibble escapes), specials and subnormals."""
    g = torch.Generator().manual_seed(seed)
    real = dtype.to_real() if dtype.is_complex else dtype
    x = torch.randn(2 * n if dtype.is_complex else n, generator=g, dtype=torch.float64) * 0.02
    x[:: 997] *= 1e6  # escapes: exponents outside the nibble window, fewer than 1/128
    x[:4] = torch.tensor([float("inf"), -0.0, float("nan"), 1e-310])
    return torch.view_as_complex(x.to(real).reshape(n, 2)) if dtype.is_complex else x.to(dtype)


def planes_file(dtype: torch.dtype, n: int) -> tuple[bytes, bytes]:
    """``(native bytes, stored zstd-planes file)``: small pieces (one pending chunk), float records
    (planes chunks: nibble, zstd and raw planes, a tail), an int64 record (a zstd chunk) and random
    bytes (a raw chunk)."""
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(200_003, generator=g, dtype=torch.float64).mul_(1e30).pow_(3)  # exponents everywhere
    pieces: list[tuple[bytes, torch.dtype | None]] = [
        (b"PK-header-like" * 7, None),
        (planes_values(dtype, n).view(torch.uint8).numpy().tobytes() + b"\x07", dtype),
        (b"small between", None),
        (wide.to(dtype).view(torch.uint8).numpy().tobytes(), dtype),
        (torch.arange(300_000).view(torch.uint8).numpy().tobytes(), torch.int64),
        (torch.randint(0, 256, (300_000,), generator=g, dtype=torch.uint8).numpy().tobytes(), None),
        (b"end", None),
    ]
    out = io.BytesIO()
    encoder = get_codec("zstd-planes").encoder(out)
    for data, hint in pieces:
        encoder.dtype_hint = hint
        encoder.write(data)
    encoder.close()
    return b"".join(d for d, _ in pieces), out.getvalue()
