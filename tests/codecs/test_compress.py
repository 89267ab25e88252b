"""Codecs: bit-exact round trips, zstd CLI interop, planes ratio, seeking, corruption, config errors."""

from __future__ import annotations

import io
import os
import shutil
import subprocess

import numpy as np
import pytest
import torch

from checkpointd.codecs import container
from checkpointd.codecs import crc as codecs_crc
from checkpointd.codecs import plane_kernels as codecs_plane_kernels
from checkpointd.codecs import planes as codecs_planes
from checkpointd.format import serialize
from checkpointd.codecs.compress import NoCodec, ZstdCodec, ZstdPlanesCodec, decode_bytes, get_codec, plane_itemsize
from checkpointd.errors import ConfigError, CorruptCheckpointError

from planes_files import legacy_encode_planes, plane_compressor

SMALL_CHUNK = 64 << 10
ZSTD_CLI = shutil.which("zstd") or ("/usr/bin/zstd" if os.path.exists("/usr/bin/zstd") else None)
ALL_DTYPES = [
    torch.float8_e4m3fn, torch.float8_e5m2, torch.bool, torch.uint8, torch.int8, torch.uint16, torch.int16,
    torch.int32, torch.int64, torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.complex64,
    torch.complex128,
]  # fmt: skip


def codecs() -> list:
    return [NoCodec(), ZstdCodec(chunk_bytes=SMALL_CHUNK), ZstdPlanesCodec(chunk_bytes=SMALL_CHUNK)]


def random_tensor(dtype: torch.dtype, numel: int, seed: int = 0) -> torch.Tensor:
    """Arbitrary bit patterns (NaNs, denormals, bool bytes > 1 included): the codec must not care."""
    gen = torch.Generator().manual_seed(seed)
    nbytes = numel * dtype.itemsize
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype)


def weights(dtype: torch.dtype, numel: int = 1 << 18, seed: int = 0) -> torch.Tensor:
    """Trained-looking weights: small Gaussians."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(numel, generator=gen) * 0.02).to(dtype)


def as_view(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B") if t.numel() else memoryview(b"")


def encode(codec, records: list[tuple[bytes | memoryview, torch.dtype | None]]) -> tuple[bytes, bytes]:
    """Feed records the way the serializer does (hint set only around tensor bytes); (encoded, native)."""
    out = io.BytesIO()
    encoder = codec.encoder(out)
    native = bytearray()
    for data, dtype in records:
        encoder.dtype_hint = dtype
        assert encoder.write(data) == memoryview(data).nbytes
        encoder.dtype_hint = None
        native += data
    encoder.close()
    return out.getvalue(), bytes(native)


def decode(codec, data: bytes) -> bytes:
    with codec.open_decoded(io.BytesIO(data)) as stream:
        return stream.read()


def serializer_pattern(tensors: list[torch.Tensor]) -> list[tuple[bytes | memoryview, torch.dtype | None]]:
    """Small metadata writes between tensor records, like the zip writer's headers."""
    records: list[tuple[bytes | memoryview, torch.dtype | None]] = [(b"PK\x03\x04header" * 3, None)]
    for i, t in enumerate(tensors):
        records += [(f"local header {i}".encode(), None), (as_view(t), t.dtype), (b"descriptor", None)]
    return records + [(b"central directory" * 10, None)]


@pytest.mark.parametrize("codec", codecs(), ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_round_trip_every_dtype(codec, dtype: torch.dtype) -> None:
    tensors = [random_tensor(dtype, n, seed=n) for n in (0, 1, 3, 1000, 40_000)]
    tensors.append(weights(dtype, 50_000) if dtype.is_floating_point and dtype.itemsize > 1 else tensors[-1])
    encoded, native = encode(codec, serializer_pattern(tensors))
    assert decode(codec, encoded) == native


@pytest.mark.parametrize("codec", codecs()[1:], ids=lambda c: c.name)
@pytest.mark.parametrize("nbytes", [0, 1, SMALL_CHUNK - 1, SMALL_CHUNK, SMALL_CHUNK + 1, 3 * SMALL_CHUNK + 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int64], ids=str)
def test_sizes_straddling_chunks_and_partial_elements(codec, nbytes: int, dtype: torch.dtype) -> None:
    """Record lengths that are not multiples of the element size still round-trip (tail stored raw)."""
    data = as_view(weights(torch.float32, nbytes // 4 + 1))[:nbytes]
    encoded, native = encode(codec, [(b"meta", None), (data, dtype), (b"more", None)])
    assert decode(codec, encoded) == native


@pytest.mark.parametrize("codec", codecs()[1:], ids=lambda c: c.name)
def test_empty_stream(codec) -> None:
    encoded, native = encode(codec, [])
    assert decode(codec, encoded) == native == b""


@pytest.mark.parametrize("codec", codecs(), ids=lambda c: c.name)
def test_real_serializer_output_loads_with_torch(codec) -> None:
    state = {
        "w32": weights(torch.float32, 70_000),
        "wbf16": weights(torch.bfloat16, 90_000),
        "f8": random_tensor(torch.float8_e4m3fn, 5000),
        "mask": torch.rand(1000) > 0.5,
        "c64": torch.randn(300, dtype=torch.complex64),
        "steps": torch.arange(10, dtype=torch.int64),
        "empty": torch.empty(0),
        "meta": {"epoch": 3, "name": "x"},
    }
    plan = serialize.plan_pt(state)
    dtypes = {key: holder.dtype for key, holder in plan.storages}
    out = io.BytesIO()
    encoder = codec.encoder(out)
    serialize.write_pt(plan, encoder, dtypes=dtypes)
    encoder.close()
    loaded = torch.load(io.BytesIO(decode(codec, out.getvalue())), weights_only=True)
    assert loaded["meta"] == state["meta"]
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            assert loaded[key].dtype == value.dtype
            assert torch.equal(loaded[key].view(torch.uint8), value.view(torch.uint8)), key


@pytest.mark.parametrize("codec", [ZstdCodec(chunk_bytes=SMALL_CHUNK), ZstdPlanesCodec(chunk_bytes=SMALL_CHUNK)])
def test_torch_load_straight_from_decoded_stream(codec) -> None:
    """torch.load seeks around inside the stream; the index serves it without decoding to bytes first."""
    state = {"a": weights(torch.float32, 100_000), "b": torch.arange(50_000)}
    plan = serialize.plan_pt(state)
    out = io.BytesIO()
    encoder = codec.encoder(out)
    serialize.write_pt(plan, encoder, dtypes={k: h.dtype for k, h in plan.storages})
    encoder.close()
    with codec.open_decoded(io.BytesIO(out.getvalue())) as stream:
        loaded = torch.load(stream, weights_only=True)
    assert torch.equal(loaded["a"], state["a"]) and torch.equal(loaded["b"], state["b"])


@pytest.mark.skipif(ZSTD_CLI is None, reason="zstd command line not installed")
def test_zstd_cli_decodes_zstd_codec_to_native_bytes(tmp_path) -> None:
    records = serializer_pattern([weights(torch.float32, 100_000), random_tensor(torch.int64, 20_000)])
    encoded, native = encode(ZstdCodec(chunk_bytes=SMALL_CHUNK), records)
    path = tmp_path / "x.pt.zst"
    path.write_bytes(encoded)
    result = subprocess.run([ZSTD_CLI, "-d", "-c", str(path)], capture_output=True, check=True)
    assert result.stdout == native


@pytest.mark.skipif(ZSTD_CLI is None, reason="zstd command line not installed")
def test_zstd_cli_on_planes_file_fails_loudly(tmp_path) -> None:
    """Never plausible wrong bytes: an error, or output that is not the file and does not load."""
    plan = serialize.plan_pt({"w": weights(torch.bfloat16, 200_000)})
    out = io.BytesIO()
    encoder = ZstdPlanesCodec(chunk_bytes=SMALL_CHUNK).encoder(out)
    serialize.write_pt(plan, encoder, dtypes={k: h.dtype for k, h in plan.storages})
    encoder.close()
    path = tmp_path / "x.pt.zst"
    path.write_bytes(out.getvalue())
    result = subprocess.run([ZSTD_CLI, "-d", "-c", str(path)], capture_output=True)
    native = decode(ZstdPlanesCodec(), out.getvalue())
    assert result.returncode != 0 or result.stdout != native
    if result.returncode == 0:
        assert b"checkpointd export" in result.stdout
        with pytest.raises(Exception):
            torch.load(io.BytesIO(result.stdout), weights_only=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_planes_beat_plain_zstd_on_trained_weights(dtype: torch.dtype) -> None:
    data = as_view(weights(dtype, 1 << 19))
    plain, native = encode(ZstdCodec(), [(data, dtype)])
    planes, _ = encode(ZstdPlanesCodec(), [(data, dtype)])
    ratio_plain, ratio_planes = len(native) / len(plain), len(native) / len(planes)
    assert ratio_planes > ratio_plain
    assert ratio_planes > (1.45 if dtype == torch.bfloat16 else 1.18)


def test_planes_store_incompressible_chunks_raw() -> None:
    data = as_view(random_tensor(torch.float32, 1 << 16))
    encoded, native = encode(ZstdPlanesCodec(chunk_bytes=SMALL_CHUNK), [(data, torch.float32)])
    assert len(encoded) < len(native) * 1.01
    assert decode(ZstdPlanesCodec(), encoded) == native


@pytest.mark.parametrize("codec", codecs()[1:], ids=lambda c: c.name)
def test_seek_decodes_only_the_chunks_it_needs(codec, monkeypatch) -> None:
    records = serializer_pattern([weights(torch.float32, 400_000), weights(torch.bfloat16, 300_000)])
    encoded, native = encode(codec, records)
    decoded_chunks = []
    original = codec.decode_into
    monkeypatch.setattr(codec, "decode_into", lambda frame, out: decoded_chunks.append(out.nbytes) or original(frame, out))
    with codec.open_decoded(io.BytesIO(encoded)) as stream:
        start = len(native) // 2 + 12_345
        assert stream.seek(start) == start and stream.tell() == start
        assert stream.read(100_000) == native[start : start + 100_000]
        assert 1 <= len(decoded_chunks) <= 3  # 100 KB spans at most 3 chunks of 64 KiB; the file has ~40
        assert stream.seek(-10, io.SEEK_END) == len(native) - 10
        assert stream.read() == native[-10:]
        assert stream.read(5) == b""


@pytest.mark.parametrize("codec", codecs()[1:], ids=lambda c: c.name)
@pytest.mark.parametrize("damage", ["truncate", "truncate-index", "flip-data", "flip-index", "garbage"])
def test_damaged_input_raises_corrupt(codec, damage: str) -> None:
    encoded, _ = encode(codec, serializer_pattern([weights(torch.bfloat16, 200_000)]))
    broken = bytearray(encoded)
    if damage == "truncate":
        broken = broken[: len(broken) // 2]
    elif damage == "truncate-index":
        broken = broken[:-3]
    elif damage == "flip-data":
        broken[len(broken) // 3] ^= 0x40
    elif damage == "flip-index":
        broken[-20] ^= 0x01
    else:
        broken = bytearray(b"not a checkpoint at all" * 10)
    with pytest.raises(CorruptCheckpointError, match="corrupt"):
        decode(codec, bytes(broken))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_a_damaged_compressed_plane_fails_its_crc_before_zstd_reads_it(dtype, monkeypatch) -> None:
    view = as_view(weights(dtype, 1 << 16))
    frame = bytearray(b"".join(bytes(memoryview(p)) for p in codecs_planes.encode_chunk(view, plane_itemsize(dtype), 1)))
    out = np.empty(view.nbytes, dtype=np.uint8)
    codecs_planes.decode_chunk_into(memoryview(bytes(frame)), out)
    assert out.tobytes() == bytes(view)
    frame[-40] ^= 0x10  # inside the last plane: the exponents' zstd frame (nibble codes)
    parsed = []
    for name in ("zstd_decompress_slack", "zstd_decompress_into"):
        real = getattr(codecs_planes, name)
        monkeypatch.setattr(codecs_planes, name, lambda *a, _real=real: parsed.append(a) or _real(*a))
    with pytest.raises(CorruptCheckpointError, match="CRC-32"):
        codecs_planes.decode_chunk_into(memoryview(bytes(frame)), out)
    assert parsed == []


def test_zero_length_and_unknown_codec_names() -> None:
    assert get_codec(None).name == get_codec("none").name == "none"
    assert get_codec("zstd").suffix == get_codec("zstd-planes").suffix == ".zst"
    assert get_codec("zstd", level=3).level == 3
    with pytest.raises(ConfigError, match="'zstd-planes'"):
        get_codec("lz4")
    with pytest.raises(ConfigError, match="level"):
        ZstdCodec(level=99)
    with pytest.raises(ConfigError, match="chunk_bytes"):
        ZstdCodec(chunk_bytes=10)


def test_decode_bytes_convenience() -> None:
    encoded, native = encode(ZstdPlanesCodec(), serializer_pattern([weights(torch.float16, 10_000)]))
    assert decode_bytes("zstd-planes", encoded) == native
    assert decode_bytes("none", native) == native


@pytest.mark.parametrize("name", ["zstd", "zstd-planes"])
def test_decoding_with_many_threads_matches_one_thread(name: str) -> None:
    """Every decode path (whole reads, straddling reads, decode_bytes, fastload) gives the same bytes
    with a pool of 1 and of 4 threads, and encoding gives the same file."""
    from concurrent.futures import ThreadPoolExecutor

    from checkpointd.restore import fastload

    tensors = [weights(torch.float32, 300_000), random_tensor(torch.bfloat16, 70_001), weights(torch.float64, 50_000)]
    records = serializer_pattern(tensors)
    with ThreadPoolExecutor(1) as one, ThreadPoolExecutor(4) as four:
        codec1 = get_codec(name, chunk_bytes=SMALL_CHUNK, executor=one)
        codec4 = get_codec(name, chunk_bytes=SMALL_CHUNK, executor=four, max_inflight=3)
        encoded, native = encode(codec1, records)
        assert encode(codec4, records)[0] == encoded
        results = []
        for codec in (codec1, codec4):
            whole = bytearray(len(native))
            with codec.open_decoded(io.BytesIO(encoded)) as stream:
                assert stream.readinto(whole) == len(native)
            pieces = bytearray()
            with codec.open_decoded(fastload.BufferReader(memoryview(encoded))) as stream:
                while piece := stream.read(100_003):  # reads that start and end inside chunks
                    pieces += piece
            stored = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
            results.append((bytes(whole), bytes(pieces), bytes(decode_bytes(name, encoded)), decode(codec, encoded)))
            assert bytes(fastload.decode_to_buffer(name, stored, len(native)).numpy()) == native
    assert results[0] == results[1] == ((native,) * 4)


def _reference_planes(raw: bytes, itemsize: int) -> list[bytes]:
    """The planes format spelled out element by element: rotate left one bit, byte j into plane j."""
    bits, planes = itemsize * 8, [bytearray() for _ in range(itemsize)]
    for start in range(0, len(raw) // itemsize * itemsize, itemsize):
        x = int.from_bytes(raw[start : start + itemsize], "little")
        rotated = ((x << 1) | (x >> (bits - 1))) & ((1 << bits) - 1)
        for j, byte in enumerate(rotated.to_bytes(itemsize, "little")):
            planes[j].append(byte)
    return [bytes(p) for p in planes]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("numel", [1, 3, 17, 1001])
def test_plane_kernels_match_reference(dtype: torch.dtype, numel: int) -> None:
    import numpy as np

    from checkpointd.codecs import planes as kernels

    gen = torch.Generator().manual_seed(numel)
    values = torch.randn(numel, generator=gen) * 0.02
    values[: min(numel, 4)] = torch.tensor([float("inf"), -0.0, float("nan"), -3.5])[: min(numel, 4)]
    itemsize = dtype.itemsize
    raw = values.to(dtype).view(torch.uint8).numpy().tobytes()
    expected = _reference_planes(raw, itemsize)
    planes = codecs_plane_kernels.to_planes(memoryview(raw), itemsize)
    assert [bytes(p) for p in planes] == expected
    out = np.zeros(len(raw), dtype=np.uint8)
    codecs_plane_kernels.from_planes([np.frombuffer(p, dtype=np.uint8) for p in expected], out)
    assert out.tobytes() == raw
    # whole chunks with an odd tail (partial element), every plane raw and every plane compressed
    for tail in (b"", b"\x7f\x01\x02"[: itemsize - 1]):
        chunk = memoryview(raw + tail)
        for worth in ([False] * itemsize, [True] * itemsize):
            parts = kernels.encode_planes(chunk, itemsize, worth)
            body = b"".join(bytes(p) for p in parts)
            if not worth[0]:  # raw planes in order after the header and plane table, then the tail
                head = kernels.CHUNK_HEADER.size + itemsize * kernels.PLANE.size
                assert body[head:] == b"".join(expected) + tail
            frame = container.FRAME_HEADER.pack(kernels.SKIPPABLE_CHUNK_MAGIC, len(body)) + body
            decoded = np.zeros(len(chunk), dtype=np.uint8)
            kernels.decode_chunk_into(memoryview(frame), decoded)
            assert decoded.tobytes() == bytes(chunk)


@pytest.mark.parametrize("numel", [1, 2, 3, 1001, 70_001])
def test_nibble_planes_round_trip_with_escapes(numel: int) -> None:
    """Mode 2 (4-bit codes, written by earlier releases): odd counts, escapes (zeros, infs, huge values),
    and damage detected."""
    import numpy as np

    from checkpointd.codecs import planes as kernels

    values = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 0.02
    values[::400] = 0.0
    values[: min(numel, 3)] = torch.tensor([float("inf"), 1e30, -0.0])[: min(numel, 3)]
    raw = values.view(torch.uint8).numpy().tobytes() + b"\x05"
    planes = codecs_plane_kernels.to_planes(memoryview(raw), 4)
    base = max(0, int(np.bincount(planes[3], minlength=256).argmax()) - 7)
    parts = legacy_encode_planes(memoryview(raw), 4, [False, False, True, True], [None, None, None, base])
    body = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
    mode = kernels.PLANE.unpack_from(body, kernels.CHUNK_HEADER.size + 3 * kernels.PLANE.size)[0]
    assert mode == (2 if numel > 10_000 else mode)
    frame = container.FRAME_HEADER.pack(kernels.SKIPPABLE_CHUNK_MAGIC, len(body)) + body
    decoded = np.zeros(len(raw), dtype=np.uint8)
    kernels.decode_chunk_into(memoryview(frame), decoded)
    assert decoded.tobytes() == raw
    broken = bytearray(frame)
    broken[-len(parts[-2]) // 2 - 2] ^= 0x10  # inside the nibble plane's zstd frame
    with pytest.raises(CorruptCheckpointError):
        kernels.decode_chunk_into(memoryview(bytes(broken)), decoded)


def test_planes_chunks_with_a_crc_of_raw_planes_only_decode() -> None:
    """Chunks with flags 1 (rotated, CRC of raw planes only): zstd planes carry their own checksum."""
    import numpy as np
    import zstandard

    from checkpointd.codecs import planes as kernels

    raw = (torch.randn(5000, generator=torch.Generator().manual_seed(3)) * 0.02).view(torch.uint8).numpy().tobytes()
    planes = codecs_plane_kernels.to_planes(memoryview(raw), 4)
    exponent = zstandard.ZstdCompressor(level=1, write_checksum=True).compress(planes[3].tobytes())
    stored = [planes[0].tobytes(), planes[1].tobytes(), planes[2].tobytes(), exponent]
    crc = codecs_crc.crc32(b"".join(stored[:3]))
    table = b"".join(kernels.PLANE.pack(0 if i < 3 else 1, len(p)) for i, p in enumerate(stored))
    body = kernels.CHUNK_HEADER.pack(kernels.KIND_PLANES, 4, 1, len(raw), crc) + table + b"".join(stored)
    frame = container.FRAME_HEADER.pack(kernels.SKIPPABLE_CHUNK_MAGIC, len(body)) + body
    decoded = np.zeros(len(raw), dtype=np.uint8)
    kernels.decode_chunk_into(memoryview(frame), decoded)
    assert decoded.tobytes() == raw


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.complex64])
def test_planes_merge_in_many_blocks_with_a_partial_last_block(dtype: torch.dtype, monkeypatch) -> None:
    """Blocks of ``MERGE_BYTES`` (byte columns for 4-byte elements, the tree otherwise) join up exactly."""
    import numpy as np

    from checkpointd.codecs import plane_kernels
    from checkpointd.codecs import planes as kernels

    monkeypatch.setattr(plane_kernels, "MERGE_BYTES", 4096)
    values = torch.randn(10_007, generator=torch.Generator().manual_seed(5)) * 0.02
    values[:3] = torch.tensor([float("inf"), -0.0, float("nan")])
    raw = values.to(dtype).view(torch.uint8).numpy().tobytes() + b"\x11"
    itemsize = plane_itemsize(dtype)
    expected = _reference_planes(raw[: len(raw) // itemsize * itemsize], itemsize)
    assert [bytes(p) for p in codecs_plane_kernels.to_planes(memoryview(raw[: len(raw) // itemsize * itemsize]), itemsize)] == expected
    frame = b"".join(bytes(memoryview(p).cast("B")) for p in kernels.encode_chunk(memoryview(raw), plane_itemsize(dtype), 1))
    decoded = np.zeros(len(raw), dtype=np.uint8)
    kernels.decode_chunk_into(memoryview(frame), decoded)
    assert decoded.tobytes() == raw
    broken = bytearray(frame)
    broken[-2] ^= 0x01  # inside the last plane (stored raw or compressed): the chunk CRC catches it
    with pytest.raises(CorruptCheckpointError):
        kernels.decode_chunk_into(memoryview(bytes(broken)), decoded)


def _planes_frame(kernels, itemsize: int, stored: list[tuple[int, bytes]], native: int) -> bytes:
    """A planes chunk frame (rotated, CRC of every stored byte) from ``(mode, stored bytes)`` per plane."""
    blobs = b"".join(blob for _, blob in stored)
    table = b"".join(kernels.PLANE.pack(mode, len(blob)) for mode, blob in stored)
    flags = kernels.FLAG_ROTATED | kernels.FLAG_CRC_ALL
    header = kernels.CHUNK_HEADER.pack(kernels.KIND_PLANES, itemsize, flags, native, codecs_crc.crc32(blobs))
    body = header + table + blobs
    return container.FRAME_HEADER.pack(kernels.SKIPPABLE_CHUNK_MAGIC, len(body)) + body


@pytest.mark.parametrize("escapes", [0, 1, 2, 5])
def test_nibble_plane_escapes_are_counted_exactly(escapes: int) -> None:
    """2-byte elements, nibble-coded high plane: escapes put back in order, a wrong count is corruption."""
    import numpy as np

    from checkpointd.codecs import planes as kernels

    count, base = 9, 100
    lo = np.arange(count, dtype=np.uint8) * 29
    hi = (base + np.arange(count) % 15).astype(np.uint8)
    hi[[1, 2, 4, 7, 8][:escapes]] = [3, 255, base + 15, 99, 250][:escapes]
    codes = np.where((hi >= base) & (hi < base + 15), hi - base, 15).astype(np.uint8)
    half = (count + 1) // 2
    padded = np.concatenate([codes, np.zeros(2 * half - count, np.uint8)])
    escaped = hi[codes == 15]
    expected = np.zeros(2 * count, dtype=np.uint8)
    codecs_plane_kernels.from_planes([lo, hi], expected)

    def frame(claimed: int, values: np.ndarray) -> memoryview:
        packed = (padded[:half] * 16 + padded[half:]).astype(np.uint8).tobytes() + values.tobytes()
        nibbles = codecs_plane_kernels.NIBBLES.pack(base, claimed) + plane_compressor().compress(packed)
        stored = [(kernels.MODE_RAW, lo.tobytes()), (kernels.MODE_NIBBLES, nibbles)]
        return memoryview(_planes_frame(kernels, 2, stored, 2 * count))

    decoded = np.zeros(2 * count, dtype=np.uint8)
    kernels.decode_chunk_into(frame(escapes, escaped), decoded)
    assert decoded.tobytes() == expected.tobytes()
    for claimed in {escapes - 1, escapes + 1} - {0, -1}:  # (0 escapes claimed: codes 15 are not looked for)
        values = np.resize(escaped if escapes else np.array([7], np.uint8), claimed)
        with pytest.raises(CorruptCheckpointError, match="escape"):
            kernels.decode_chunk_into(frame(claimed, values), decoded)


@pytest.mark.parametrize("extra", [-1, 1])
def test_zstd_plane_of_the_wrong_size_is_corrupt(extra: int) -> None:
    """A compressed plane must decode to exactly one byte per element, not one more or one fewer."""
    import numpy as np

    from checkpointd.codecs import planes as kernels

    count = 1000
    plane = bytes(range(256)) * 4
    wrong = plane_compressor().compress(plane[: count + extra])
    stored = [(kernels.MODE_RAW, plane[:count]), (kernels.MODE_ZSTD, wrong)]
    decoded = np.zeros(2 * count, dtype=np.uint8)
    with pytest.raises(CorruptCheckpointError, match="decodes to"):
        kernels.decode_chunk_into(memoryview(_planes_frame(kernels, 2, stored, 2 * count)), decoded)
    stored = [(kernels.MODE_ZSTD, wrong), (kernels.MODE_RAW, plane[:count])]  # first plane: slack is the next plane's
    with pytest.raises(CorruptCheckpointError, match="decodes to"):
        kernels.decode_chunk_into(memoryview(_planes_frame(kernels, 2, stored, 2 * count)), decoded)
