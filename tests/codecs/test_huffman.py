"""Huffman-coded planes (``codecs.huffman``): exact round trips with the C and NumPy coders, the same
bytes from both, code lengths within the limit, and every malformed or forged plane refused."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from checkpointd.codecs import huffman, plane_kernels
from checkpointd.errors import CorruptCheckpointError

from planes_files import plane_compressor
from checkpointd.native import planes as planes_native


def _numpy_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(planes_native, "library", lambda: None)


def _stored(plane: np.ndarray) -> bytes:
    return b"".join(bytes(memoryview(p).cast("B")) for p in huffman.encode(plane))


def _plane(kind: str, count: int) -> np.ndarray:
    rng = np.random.default_rng(count)
    if kind == "exponents":
        return (rng.geometric(0.35, count).clip(1, 60) + 100).astype(np.uint8)
    if kind == "uniform":
        return rng.integers(0, 256, count, dtype=np.uint8)
    if kind == "one value":
        return np.full(count, 7, dtype=np.uint8)
    if kind == "two values":
        return rng.choice(np.array([3, 250], dtype=np.uint8), count)
    # "deep": Fibonacci-like frequencies, whose Huffman tree is deeper than the limit
    fib = [1, 1]
    while len(fib) < 24:
        fib.append(fib[-1] + fib[-2])
    return np.repeat(np.arange(24, dtype=np.uint8), fib)[rng.permutation(sum(fib))][:count]


@pytest.mark.parametrize("kind", ["exponents", "uniform", "one value", "two values", "deep"])
@pytest.mark.parametrize("count", [1, 5, 4095, 4096, 4097, 70_001])
def test_round_trip_with_the_c_and_numpy_coders_alike(kind, count, monkeypatch) -> None:
    plane = _plane(kind, count)
    count = plane.size
    stored = _stored(plane)
    with monkeypatch.context() as m:
        _numpy_only(m)
        assert _stored(plane) == stored, "the NumPy encoder wrote other bytes than the C one"
        out = np.zeros(count, dtype=np.uint8)
        huffman.decode_into(stored, out)
        assert np.array_equal(out, plane)
    if planes_native.library() is not None:
        out = np.zeros(count, dtype=np.uint8)
        huffman.decode_into(stored, out)
        assert np.array_equal(out, plane)


@pytest.mark.parametrize("scale", [0.02, 1e-4])
def test_exponent_planes_code_as_small_as_zstd_does_them(scale) -> None:
    """Weights-like fp32 exponents: within 1% of zstd's plane compressor (what earlier releases stored)."""
    values = (np.random.default_rng(3).standard_normal(1 << 20) * scale).astype(np.float32)
    exponents = plane_kernels.to_planes(memoryview(values.view(np.uint8)), 4)[3].copy()
    coded = len(_stored(exponents))
    assert coded < 1.01 * len(plane_compressor().compress(exponents))
    assert coded < exponents.size / 2.9


def test_code_lengths_stay_within_the_limit_and_form_a_prefix_code() -> None:
    counts = np.zeros(256, dtype=np.int64)
    fib = [1, 1]
    while len(fib) < 30:
        fib.append(fib[-1] + fib[-2])
    counts[:30] = fib
    lengths = huffman.code_lengths(counts)
    assert lengths.max() == huffman.MAX_BITS
    assert (lengths[:30] > 0).all() and (lengths[30:] == 0).all()
    assert sum(2.0 ** -int(n) for n in lengths[lengths > 0]) <= 1.0
    table = huffman.decode_table(lengths)
    assert set(np.unique(table & 255)[np.unique(table) > 0]) <= set(range(30))


# -- malformed and forged planes ---------------------------------------------------------------------


def _parts(count: int = 10_000) -> tuple[np.ndarray, bytearray]:
    plane = _plane("exponents", count)
    return plane, bytearray(_stored(plane))


ENDS_AT = huffman.HEADER.size + 128


def _set_length(data: bytearray, symbol: int, length: int) -> None:
    byte = huffman.HEADER.size + symbol // 2
    shift = 4 * (symbol % 2)
    data[byte] = (data[byte] & ~(15 << shift)) | (length << shift)


@pytest.mark.parametrize("damage,match", [
    ("short header", "too short for its header"),
    ("block count", "blocks of"),
    ("zero block size", "blocks of"),
    ("length over the limit", "no prefix code"),
    ("over-full code", "no prefix code"),
    ("no codes", "no prefix code"),
    ("ends decreasing", "not increasing"),
    ("stream one byte long", "do not end with its stream"),
    ("stream one byte short", "do not end with its stream"),
    ("table cut", "too short for"),
])
def test_malformed_planes_are_refused_before_decoding(damage, match) -> None:
    plane, data = _parts()
    if damage == "short header":
        data = data[:20]
    elif damage == "block count":
        struct.pack_into("<I", data, 4, 4)
    elif damage == "zero block size":
        struct.pack_into("<I", data, 0, 0)
    elif damage == "length over the limit":
        _set_length(data, int(plane[0]), 12)
    elif damage == "over-full code":
        data[huffman.HEADER.size : ENDS_AT] = bytes([0x11]) * 128  # 256 codes of one bit
    elif damage == "no codes":
        data[huffman.HEADER.size : ENDS_AT] = bytes(128)
    elif damage == "ends decreasing":
        first, second = struct.unpack_from("<II", data, ENDS_AT)
        struct.pack_into("<II", data, ENDS_AT, second + 1, second)
    elif damage == "stream one byte long":
        data += b"\x00"
    elif damage == "stream one byte short":
        data = data[:-1]
    elif damage == "table cut":
        data = data[: ENDS_AT + 4]
    with pytest.raises(CorruptCheckpointError, match=match):
        huffman.decode_into(bytes(data), np.zeros(plane.size, dtype=np.uint8))


@pytest.mark.parametrize("numpy_only", [False, True])
@pytest.mark.parametrize("forgery", ["end later", "end earlier", "unassigned pattern", "symbol count"])
def test_forged_planes_that_parse_do_not_decode(forgery, numpy_only, monkeypatch) -> None:
    """A plane that passes every header check but whose blocks do not decode to exactly their symbols."""
    if numpy_only:
        _numpy_only(monkeypatch)
    elif planes_native.library() is None:
        pytest.skip("native plane kernels unavailable")
    plane, data = _parts()
    count = plane.size
    if forgery in ("end later", "end earlier"):
        first, second = struct.unpack_from("<II", data, ENDS_AT)
        struct.pack_into("<I", data, ENDS_AT, first + (1 if forgery == "end later" else -1))
    elif forgery == "unassigned pattern":
        lengths = huffman.read_plane(bytes(data), count).lengths
        longest = int(np.argmax(lengths))  # one of the longest codes: dropping it leaves its patterns unassigned
        _set_length(data, longest, 0)
        if longest not in plane:
            pytest.skip("the longest code is unused")
    else:
        count += 1  # one symbol more than the blocks hold: the last block runs out of bits
        struct.pack_into("<I", data, 4, -(-count // huffman.BLOCK))
    with pytest.raises(CorruptCheckpointError, match="does not decode"):
        huffman.decode_into(bytes(data), np.zeros(count, dtype=np.uint8))


def test_a_block_reads_only_its_own_bytes() -> None:
    """Whatever follows a block's last byte, its decoding (and refusal) is the same."""
    plane, data = _parts()
    layout = huffman.read_plane(bytes(data), plane.size)
    blocks, tables = huffman.block_table(layout, plane.size)
    short = blocks[:1].copy()
    short[0, 1] -= 9  # block 0 ends early: its codes run past its end
    results = []
    for fill in (0x00, 0xFF):
        src = bytearray(data)
        last = (int(short[0, 1]) + 7) // 8
        src[last:] = bytes([fill]) * (len(src) - last)
        out = np.zeros(plane.size, dtype=np.uint8)
        results.append((huffman.decode_blocks(bytes(src), out, short, tables), out.tobytes()))
    assert results[0][0] == results[1][0] == 1


def test_codes_are_deflates_canonical_codes_written_most_significant_bit_first() -> None:
    """The format's code assignment (docs/format.md), computed the way RFC 1951 section 3.2.2 does."""
    lengths = huffman.code_lengths(np.bincount(_plane("exponents", 50_000), minlength=256))
    bl_count = np.bincount(lengths[lengths > 0], minlength=huffman.MAX_BITS + 1)
    next_code, code = [0] * (huffman.MAX_BITS + 2), 0
    for bits in range(1, huffman.MAX_BITS + 1):
        code = (code + int(bl_count[bits - 1] if bits > 1 else 0)) << 1
        next_code[bits] = code
    codes = huffman.canonical_codes(lengths)
    for value in range(256):
        n = int(lengths[value])
        if n:
            expected = next_code[n]
            next_code[n] += 1
            assert int(codes[value]) == int(f"{expected:0{n}b}"[::-1], 2), value
    # 5 twice (code 0), 6 and 7 once (codes 10 and 11): 6 5 7 5 is 10 0 11 0, least significant bit first
    stored = _stored(np.array([6, 5, 7, 5], dtype=np.uint8))
    layout = huffman.read_plane(stored, 4)
    assert list(layout.lengths[5:8]) == [1, 2, 2]
    assert stored[layout.stream[0] :] == bytes([0b011001])
