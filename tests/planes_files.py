"""``zstd-planes`` files with every kind of chunk, for the decoders' tests (host and device).

Files written today store raw and Huffman planes. Files written by earlier releases also hold
nibble-coded and zstd planes, which every decoder still reads: :func:`legacy_encode_planes` writes
those (the earlier encoder, kept here only to make them), and ``planes_file(..., legacy=True)`` a whole
file of them.
"""

from __future__ import annotations

import contextlib
import io
from typing import Any, Iterator

import numpy as np
import torch
import zstandard

from checkpointd.codecs import planes
from checkpointd.codecs.compress import get_codec
from checkpointd.codecs.crc import crc32
from checkpointd.codecs.plane_kernels import ESCAPE, NIBBLES, to_planes


def plane_compressor() -> zstandard.ZstdCompressor:
    """The zstd settings earlier releases compressed planes with (Huffman literals, almost no matches,
    no frame checksum: the chunk's CRC-32 covers the stored bytes)."""
    params = zstandard.ZstdCompressionParameters(
        strategy=zstandard.STRATEGY_FAST, window_log=17, hash_log=6, chain_log=6, search_log=1,
        min_match=7, target_length=0, write_checksum=False,
    )  # fmt: skip
    return zstandard.ZstdCompressor(compression_params=params)


def planes_values(dtype: torch.dtype, n: int, seed: int = 0) -> torch.Tensor:
    """Weights-like values with a few outliers (nibble escapes), specials and subnormals."""
    g = torch.Generator().manual_seed(seed)
    real = dtype.to_real() if dtype.is_complex else dtype
    x = torch.randn(2 * n if dtype.is_complex else n, generator=g, dtype=torch.float64) * 0.02
    x[:: 997] *= 1e6  # escapes: exponents outside the nibble window, fewer than 1/128
    x[:4] = torch.tensor([float("inf"), -0.0, float("nan"), 1e-310])
    return torch.view_as_complex(x.to(real).reshape(n, 2)) if dtype.is_complex else x.to(dtype)


def planes_file(dtype: torch.dtype, n: int, legacy: bool = False) -> tuple[bytes, bytes]:
    """``(native bytes, stored zstd-planes file)``: small pieces (one pending chunk), float records
    (planes chunks: Huffman and raw planes, or with ``legacy`` nibble, zstd and raw planes; a tail), an
    int64 record (a zstd chunk) and random bytes (a raw chunk)."""
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
    with legacy_encoder() if legacy else contextlib.nullcontext():
        encoder = get_codec("zstd-planes").encoder(out)
        for data, hint in pieces:
            encoder.dtype_hint = hint
            encoder.write(data)
        encoder.close()
    return b"".join(d for d, _ in pieces), out.getvalue()


@contextlib.contextmanager
def legacy_encoder() -> Iterator[None]:
    """Encode planes chunks as earlier releases did while inside (one pool thread is enough for tests)."""
    current = planes.encode_planes
    planes.encode_planes = legacy_encode_planes  # type: ignore[assignment]
    try:
        yield
    finally:
        planes.encode_planes = current  # type: ignore[assignment]


def legacy_encode_planes(view: memoryview, itemsize: int, worth: list[bool],
                         bases: list[int | None] | None = None) -> list[Any]:
    """Chunk payload parts of kind planes as earlier releases wrote them: a plane whose values fall
    (almost) all within 15 consecutive values is nibble-coded, other compressible planes are zstd frames.
    ``bases``: each plane's nibble window (default: chosen here)."""
    whole = view.nbytes // itemsize * itemsize
    split = to_planes(view[:whole], itemsize)
    table, blobs, crc = [], [], 0
    for i, (plane, compress) in enumerate(zip(split, worth)):
        base = bases[i] if bases is not None else (_window(plane) if compress else None)
        parts = legacy_nibbles(plane, base) if base is not None else None
        mode = planes.MODE_NIBBLES
        if parts is None and compress:
            parts, mode = [plane_compressor().compress(plane)], planes.MODE_ZSTD
        stored = sum(len(p) for p in parts) if parts is not None else plane.nbytes
        if parts is None or stored >= plane.nbytes:
            parts, mode, stored = [plane], planes.MODE_RAW, plane.nbytes
        table.append(planes.PLANE.pack(mode, stored))
        for part in parts:
            crc = crc32(part, crc)
        blobs += parts
    crc = crc32(view[whole:], crc)
    flags = planes.FLAG_ROTATED | planes.FLAG_CRC_ALL
    header = planes.CHUNK_HEADER.pack(planes.KIND_PLANES, itemsize, flags, view.nbytes, crc) + b"".join(table)
    return [header, *blobs, view[whole:]]


def _window(plane: np.ndarray) -> int | None:
    """The base of the 15-value window holding >= 99.5% of the plane, or None."""
    counts = np.bincount(plane, minlength=256)
    window = np.convolve(counts, np.ones(ESCAPE, dtype=np.int64), mode="valid")
    base = int(window.argmax())
    return base if plane.size and window[base] >= 0.995 * plane.size else None


def legacy_nibbles(plane: np.ndarray, base: int) -> list[Any] | None:
    """A plane as 4-bit codes ``value - base`` (15: escape), two a byte, zstd-compressed with the escapes
    (plane mode 2 of ``docs/format.md``); None if more than 1/128 of the plane escapes."""
    count, half = plane.size, (plane.size + 1) // 2
    codes = np.zeros(2 * half, dtype=np.uint8)
    codes[:count] = plane - np.uint8(base)
    escapes = np.flatnonzero(codes[:count] >= ESCAPE)
    if escapes.size * 128 > count:
        return None
    codes[escapes] = ESCAPE
    packed = np.concatenate([codes[:half] * np.uint8(16) | codes[half:], plane[escapes]])
    return [NIBBLES.pack(base, escapes.size), plane_compressor().compress(packed.data)]
