"""Native plane kernels: the same bytes as the NumPy kernels both ways, damage found, safe fallback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from checkpointd.codecs import planes as kernels
from checkpointd.native import planes as planes_native
from checkpointd.errors import CorruptCheckpointError

FLOATS = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.complex64]


@pytest.fixture(scope="module")
def lib():
    """The compiled library; in CI (CI=true) a missing compiler fails these tests instead of skipping."""
    loaded = planes_native.library()
    if loaded is None:
        if os.environ.get("CI", "").lower() in {"1", "true", "yes"}:
            pytest.fail(f"native plane kernels unavailable in CI: {planes_native.why_not}", pytrace=False)
        pytest.skip(f"native plane kernels unavailable: {planes_native.why_not}")
    return loaded


def _numpy_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(planes_native, "library", lambda: None)


def _frame(parts: list) -> memoryview:
    return memoryview(b"".join(bytes(memoryview(p).cast("B")) for p in parts))


def _values(dtype: torch.dtype, numel: int, seed: int, escapes_every: int) -> bytes:
    """Trained-looking values with specials and exponents far from the rest (nibble escapes), plus a tail byte."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(numel, generator=gen) * 0.02
    if escapes_every:
        values[::escapes_every] = torch.randn(values[::escapes_every].shape, generator=gen) * 1e6
        values[1::escapes_every * 3] = 0.0
    values[: min(numel, 4)] = torch.tensor([float("inf"), -0.0, float("nan"), -3.5])[: min(numel, 4)]
    if dtype.is_complex:
        values = torch.complex(values, values.flip(0))
    return values.to(dtype).view(torch.uint8).numpy().tobytes() + b"\x7f"


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("numel,escapes_every", [(1, 0), (7, 0), (4097, 0), (70_001, 0), (70_001, 300), (200_003, 4000)])
def test_native_and_numpy_encode_the_same_bytes_and_decode_each_other(lib, dtype, numel, escapes_every, monkeypatch) -> None:
    raw = _values(dtype, numel, numel + escapes_every, escapes_every)
    view = memoryview(raw)
    native_frame = _frame(kernels.encode_chunk(view, dtype, 1))
    native_out = np.zeros(len(raw), dtype=np.uint8)
    kernels.decode_chunk_into(native_frame, native_out)
    with monkeypatch.context() as m:
        _numpy_only(m)
        numpy_frame = _frame(kernels.encode_chunk(view, dtype, 1))
        numpy_out = np.zeros(len(raw), dtype=np.uint8)
        kernels.decode_chunk_into(native_frame, numpy_out)  # NumPy decodes what native wrote
    assert bytes(native_frame) == bytes(numpy_frame)
    assert native_out.tobytes() == raw and numpy_out.tobytes() == raw
    kernels.decode_chunk_into(numpy_frame, native_out)  # and native decodes what NumPy wrote
    assert native_out.tobytes() == raw


@pytest.mark.parametrize("itemsize", [2, 4, 8])
@pytest.mark.parametrize("count", [1, 2, 3, 4095, 4096, 4097, 9000])
def test_split_and_merge_match_the_numpy_kernels_on_every_bit_pattern(lib, itemsize, count, monkeypatch) -> None:
    raw = np.random.default_rng(count * itemsize).integers(0, 256, count * itemsize, dtype=np.uint8).tobytes()
    planes = kernels._to_planes(memoryview(raw), itemsize)
    with monkeypatch.context() as m:
        _numpy_only(m)
        expected = kernels._to_planes(memoryview(raw), itemsize)
    assert planes.tobytes() == expected.tobytes()
    for rotated in (True, False):
        out = np.zeros(len(raw), dtype=np.uint8)
        described = [(0, planes[j], 0, None, 0) for j in range(itemsize)]
        assert planes_native.decode_planes(lib, described, count, rotated, out) == 0
        reference = np.zeros(len(raw), dtype=np.uint8)
        kernels._from_planes(list(expected), reference, rotated=rotated)
        assert out.tobytes() == reference.tobytes()
    out = np.zeros(len(raw), dtype=np.uint8)
    planes_native.decode_planes(lib, [(0, planes[j], 0, None, 0) for j in range(itemsize)], count, True, out)
    assert out.tobytes() == raw


@pytest.mark.parametrize("count", [1, 2, 255, 256, 257, 9001])
def test_pack_nibbles_matches_numpy_and_refuses_too_many_escapes(lib, count, monkeypatch) -> None:
    rng = np.random.default_rng(count)
    plane = (100 + rng.integers(0, 15, count)).astype(np.uint8)
    escapes_at = rng.choice(count, size=max(1, count // 200), replace=False)
    plane[escapes_at] = rng.choice([0, 99, 115, 255], size=escapes_at.size)
    got = kernels._pack_nibbles(plane, 100)
    with monkeypatch.context() as m:
        _numpy_only(m)
        expected = kernels._pack_nibbles(plane, 100)
    if expected is None:  # more than 1/128 escaped: both refuse
        assert got is None
        return
    assert got is not None and [bytes(p) for p in got] == [bytes(p) for p in expected]
    packed = np.zeros((count + 1) // 2 + count, dtype=np.uint8)
    escaped = int(np.count_nonzero((plane.astype(np.int16) - 100) % 256 >= 15))
    assert planes_native.pack_nibbles(lib, plane, 100, packed, escaped) == escaped
    assert planes_native.pack_nibbles(lib, plane, 100, packed, escaped - 1) == -1


@pytest.mark.parametrize("claimed_delta", [-1, 1])
def test_native_decode_refuses_a_wrong_escape_count(lib, claimed_delta) -> None:
    count, base = 20_000, 100
    rng = np.random.default_rng(7)
    lo = rng.integers(0, 256, count, dtype=np.uint8)
    hi = (base + rng.integers(0, 15, count)).astype(np.uint8)
    hi[[0, 4095, 4096, 19_999]] = [3, 255, 99, 115]  # first and last element, either side of a block edge
    packed = np.zeros((count + 1) // 2 + 8, dtype=np.uint8)
    escaped = planes_native.pack_nibbles(lib, hi, base, packed, 8)
    assert escaped == 4
    out = np.zeros(2 * count, dtype=np.uint8)
    half = (count + 1) // 2
    plane = (1, packed, base, packed[half:], escaped)
    assert planes_native.decode_planes(lib, [(0, lo, 0, None, 0), plane], count, True, out) == 0
    reference = np.zeros(2 * count, dtype=np.uint8)
    kernels._from_planes([lo, hi], reference)
    assert out.tobytes() == reference.tobytes()
    wrong = (1, packed, base, packed[half:], escaped + claimed_delta)
    assert planes_native.decode_planes(lib, [(0, lo, 0, None, 0), wrong], count, True, out) == 2


def test_the_compiled_library_is_cached_and_reused(lib, tmp_path, monkeypatch) -> None:
    """A fresh process with an empty cache folder builds once; the next one loads the same file."""
    cache = tmp_path / "cache"
    code = "from checkpointd import planes_native as n; lib = n.library(); print(lib._name if lib else 'NONE', n.why_not)"
    env = {**os.environ, "CHECKPOINTD_CACHE_DIR": str(cache), "PYTHONPATH": str(Path(kernels.__file__).parents[2])}
    first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180)
    assert first.returncode == 0, first.stderr
    built = list(cache.glob("planes-*.so"))
    assert len(built) == 1 and first.stdout.split()[0] == str(built[0])
    mtime = built[0].stat().st_mtime_ns
    second = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180)
    assert second.returncode == 0 and second.stdout.split()[0] == str(built[0])
    assert built[0].stat().st_mtime_ns == mtime and list(cache.iterdir()) == built  # no temporaries left


@pytest.mark.parametrize("setting", ["off", "no compiler", "compiler fails"])
def test_without_native_kernels_the_numpy_ones_run(setting, tmp_path, monkeypatch) -> None:
    raw = _values(torch.bfloat16, 50_000, 3, 500)
    monkeypatch.setenv("CHECKPOINTD_CACHE_DIR", str(tmp_path / "cache"))
    if setting == "off":
        monkeypatch.setenv("CHECKPOINTD_NATIVE", "0")
    elif setting == "no compiler":
        monkeypatch.setenv("CC", "/nonexistent/cc")
    else:
        monkeypatch.setenv("CC", "false")  # found, exits 1
    planes_native.reset()
    try:
        assert planes_native.library() is None
        assert planes_native.why_not
        frame = _frame(kernels.encode_chunk(memoryview(raw), torch.bfloat16, 1))
        out = np.zeros(len(raw), dtype=np.uint8)
        kernels.decode_chunk_into(frame, out)
        assert out.tobytes() == raw
    finally:
        planes_native.reset()
    assert not list(tmp_path.rglob("*.so"))


def test_damaged_planes_chunk_is_refused_by_the_native_decoder(lib) -> None:
    raw = _values(torch.bfloat16, 100_000, 11, 700)
    frame = bytearray(_frame(kernels.encode_chunk(memoryview(raw), torch.bfloat16, 1)))
    out = np.zeros(len(raw), dtype=np.uint8)
    for offset in (40, len(frame) // 2, len(frame) - 3):
        broken = bytearray(frame)
        broken[offset] ^= 0x04
        with pytest.raises(CorruptCheckpointError):
            kernels.decode_chunk_into(memoryview(bytes(broken)), out)


def test_a_cache_folder_others_can_write_is_not_used(lib, tmp_path, monkeypatch) -> None:
    """Code in a folder someone else can write could be theirs: the private fallback folder is used."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("CHECKPOINTD_CACHE_DIR", str(shared))
    planes_native.reset()
    try:
        loaded = planes_native.library()
        assert loaded is not None and not loaded._name.startswith(str(shared))
        assert not list(shared.iterdir())
    finally:
        planes_native.reset()


def test_no_private_folder_at_all_leaves_the_numpy_kernels_and_says_why(tmp_path, monkeypatch) -> None:
    import tempfile

    blocker = tmp_path / "file"
    blocker.write_bytes(b"x")  # a file where both folders would be made
    monkeypatch.setenv("CHECKPOINTD_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.setattr(tempfile, "tempdir", str(blocker))
    planes_native.reset()
    try:
        assert planes_native.library() is None
        assert "CHECKPOINTD_CACHE_DIR" in planes_native.why_not and str(blocker / "cache") in planes_native.why_not
    finally:
        planes_native.reset()
