"""Native plane kernels: the same bytes as the NumPy kernels both ways, damage found, the NumPy fallback
where the library is off, absent or unusable."""

from __future__ import annotations

import importlib.machinery
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from checkpointd import options
from checkpointd.codecs import plane_kernels
from checkpointd.codecs.compress import plane_itemsize
from checkpointd.codecs import planes as kernels
from checkpointd.errors import CorruptCheckpointError
from checkpointd.native import loader
from checkpointd.native import planes as planes_native

from planes_files import legacy_encoder

FLOATS = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.complex64]


@pytest.fixture(scope="module")
def lib():
    """The library built at install; in CI (CI=true) a missing one fails these tests instead of skipping."""
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
    native_frame = _frame(kernels.encode_chunk(view, plane_itemsize(dtype), 1))
    native_out = np.zeros(len(raw), dtype=np.uint8)
    kernels.decode_chunk_into(native_frame, native_out)
    with monkeypatch.context() as m:
        _numpy_only(m)
        numpy_frame = _frame(kernels.encode_chunk(view, plane_itemsize(dtype), 1))
        numpy_out = np.zeros(len(raw), dtype=np.uint8)
        kernels.decode_chunk_into(native_frame, numpy_out)  # NumPy decodes what native wrote
    assert bytes(native_frame) == bytes(numpy_frame)
    assert native_out.tobytes() == raw and numpy_out.tobytes() == raw
    kernels.decode_chunk_into(numpy_frame, native_out)  # and native decodes what NumPy wrote
    assert native_out.tobytes() == raw


@pytest.mark.parametrize("itemsize", [2, 4, 8])
@pytest.mark.parametrize("count", [1, 2, 3, 31, 32, 33, 4095, 4096, 4097, 4127, 9000])
def test_split_and_merge_match_the_numpy_kernels_on_every_bit_pattern(lib, itemsize, count, monkeypatch) -> None:
    raw = np.random.default_rng(count * itemsize).integers(0, 256, count * itemsize, dtype=np.uint8).tobytes()
    planes = plane_kernels.to_planes(memoryview(raw), itemsize)
    with monkeypatch.context() as m:
        _numpy_only(m)
        expected = plane_kernels.to_planes(memoryview(raw), itemsize)
    assert planes.tobytes() == expected.tobytes()
    for rotated in (True, False):
        out = np.zeros(len(raw), dtype=np.uint8)
        described = [(0, planes[j], 0, None, 0) for j in range(itemsize)]
        assert planes_native.decode_planes(lib, described, count, rotated, out) == 0
        reference = np.zeros(len(raw), dtype=np.uint8)
        plane_kernels.from_planes(list(expected), reference, rotated=rotated)
        assert out.tobytes() == reference.tobytes()
    out = np.zeros(len(raw), dtype=np.uint8)
    planes_native.decode_planes(lib, [(0, planes[j], 0, None, 0) for j in range(itemsize)], count, True, out)
    assert out.tobytes() == raw


@pytest.mark.parametrize("dtype", FLOATS)
def test_native_and_numpy_decode_earlier_releases_nibble_and_zstd_planes_alike(lib, dtype, monkeypatch) -> None:
    raw = _values(dtype, 70_001, 5, 300)
    itemsize = plane_itemsize(dtype)
    with legacy_encoder():
        frame = _frame(kernels.encode_chunk(memoryview(raw), itemsize, 1))
    modes = {kernels.PLANE.unpack_from(frame, 8 + kernels.CHUNK_HEADER.size + 8 * j)[0] for j in range(itemsize)}
    assert modes & {kernels.MODE_NIBBLES, kernels.MODE_ZSTD} and kernels.MODE_HUFFMAN not in modes
    native_out = np.zeros(len(raw), dtype=np.uint8)
    kernels.decode_chunk_into(frame, native_out)
    with monkeypatch.context() as m:
        _numpy_only(m)
        numpy_out = np.zeros(len(raw), dtype=np.uint8)
        kernels.decode_chunk_into(frame, numpy_out)
    assert native_out.tobytes() == raw and numpy_out.tobytes() == raw


@pytest.mark.parametrize("claimed_delta", [-1, 1])
def test_native_decode_refuses_a_wrong_escape_count(lib, claimed_delta) -> None:
    count, base = 20_000, 100
    rng = np.random.default_rng(7)
    lo = rng.integers(0, 256, count, dtype=np.uint8)
    hi = (base + rng.integers(0, 15, count)).astype(np.uint8)
    hi[[0, 4095, 4096, 19_999]] = [3, 255, 99, 115]  # first and last element, either side of a block edge
    half = (count + 1) // 2
    codes = np.zeros(2 * half, dtype=np.uint8)
    codes[:count] = np.minimum(hi - np.uint8(base), 15)
    packed = np.concatenate([codes[:half] * np.uint8(16) | codes[half:], hi[codes[:count] == 15]])
    escaped = packed.size - half
    assert escaped == 4
    out = np.zeros(2 * count, dtype=np.uint8)
    plane = (1, packed, base, packed[half:], escaped)
    assert planes_native.decode_planes(lib, [(0, lo, 0, None, 0), plane], count, True, out) == 0
    reference = np.zeros(2 * count, dtype=np.uint8)
    plane_kernels.from_planes([lo, hi], reference)
    assert out.tobytes() == reference.tobytes()
    wrong = (1, packed, base, packed[half:], escaped + claimed_delta)
    assert planes_native.decode_planes(lib, [(0, lo, 0, None, 0), wrong], count, True, out) == 2


def test_the_library_built_at_install_is_loaded_from_the_package_folder(lib, tmp_path) -> None:
    """A fresh process loads the shared object the install built beside the module: nothing is compiled and
    no cache folder is written."""
    cache = tmp_path / "cache"
    code = "from checkpointd.native import planes as n; lib = n.library(); print(lib._name if lib else 'NONE', n.why_not)"
    env = {**os.environ, options.CACHE_DIR_ENV: str(cache), "CC": "/nonexistent/cc",
           "PYTHONPATH": str(Path(kernels.__file__).parents[2])}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr
    built = loader.built_library(planes_native.LIBRARY.folder, "planes_native")
    assert built is not None and run.stdout.split()[0] == str(built) == lib._name
    assert built.parent == Path(planes_native.__file__).resolve().parent
    assert not cache.exists()


def test_loading_never_runs_a_compiler(monkeypatch) -> None:
    def no_compiler(*args, **kwargs):
        raise AssertionError(f"loading the native kernels started a process: {args}")

    monkeypatch.setattr(subprocess, "run", no_compiler)
    monkeypatch.setattr(subprocess, "Popen", no_compiler)
    planes_native.reset()
    try:
        planes_native.library()  # loaded, or None with the reason: never compiled here
    finally:
        planes_native.reset()


def _garbage_library(folder: Path) -> None:
    folder.mkdir()
    (folder / f"planes_native{importlib.machinery.EXTENSION_SUFFIXES[0]}").write_bytes(b"not a shared object")


@pytest.mark.parametrize("setting", ["off", "not built", "not a library", "another ABI"])
def test_without_native_kernels_the_numpy_ones_run(setting, tmp_path, monkeypatch) -> None:
    raw = _values(torch.bfloat16, 50_000, 3, 500)
    if setting == "another ABI" and loader.built_library(planes_native.LIBRARY.folder, "planes_native") is None:
        pytest.skip("the ABI check needs the library built at install")
    monkeypatch.delenv(options.NATIVE_ENV, raising=False)
    if setting == "off":
        monkeypatch.setenv(options.NATIVE_ENV, "0")
    elif setting == "not built":
        monkeypatch.setattr(planes_native.LIBRARY, "folder", tmp_path)
    elif setting == "not a library":
        _garbage_library(tmp_path / "pkg")
        monkeypatch.setattr(planes_native.LIBRARY, "folder", tmp_path / "pkg")
    else:
        monkeypatch.setattr(planes_native.LIBRARY, "abi", ("cpd_abi", planes_native.ABI + 1))
    planes_native.reset()
    try:
        assert planes_native.library() is None
        assert planes_native.why_not
        if setting == "off":
            assert options.NATIVE_ENV in planes_native.why_not
        elif setting == "not built":
            assert "build_ext --inplace" in planes_native.why_not and str(tmp_path) in planes_native.why_not
        elif setting == "another ABI":
            assert f"expected {planes_native.ABI + 1}" in planes_native.why_not
        frame = _frame(kernels.encode_chunk(memoryview(raw), 2, 1))
        out = np.zeros(len(raw), dtype=np.uint8)
        kernels.decode_chunk_into(frame, out)
        assert out.tobytes() == raw
    finally:
        planes_native.reset()


def test_damaged_planes_chunk_is_refused_by_the_native_decoder(lib) -> None:
    raw = _values(torch.bfloat16, 100_000, 11, 700)
    frame = bytearray(_frame(kernels.encode_chunk(memoryview(raw), 2, 1)))
    out = np.zeros(len(raw), dtype=np.uint8)
    for offset in (40, len(frame) // 2, len(frame) - 3):
        broken = bytearray(frame)
        broken[offset] ^= 0x04
        with pytest.raises(CorruptCheckpointError):
            kernels.decode_chunk_into(memoryview(bytes(broken)), out)


def test_native_code_lengths_are_the_pythons_on_ties_and_skew(lib, monkeypatch) -> None:
    from checkpointd.codecs import huffman

    rng = np.random.default_rng(3)
    cases = []
    for high in (2, 3, 50, 10**9):
        for _ in range(150):
            counts = np.zeros(256, dtype=np.int64)
            present = rng.choice(256, int(rng.integers(1, 257)), replace=False)
            counts[present] = rng.integers(1, high, present.size)
            cases.append(counts)
    skewed = np.zeros(256, dtype=np.int64)
    skewed[:40] = (1 << 24) >> np.arange(40)  # geometric: needs many halvings to fit 11 bits
    cases += [skewed, np.zeros(256, dtype=np.int64), np.eye(256, dtype=np.int64)[7] * 9, np.ones(256, dtype=np.int64)]
    native = [huffman.code_lengths(c) for c in cases]
    assert native[-4].max() == huffman.MAX_BITS
    monkeypatch.setattr(planes_native, "library", lambda: None)
    for counts, lengths in zip(cases, native):
        assert np.array_equal(lengths, huffman.code_lengths(counts)), counts
    with pytest.raises(ValueError, match="256 counts"):
        planes_native.code_lengths(lib, np.ones(255, dtype=np.int64), 11)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_native_sample_entropies_are_numpys(lib, dtype) -> None:
    raw = _values(dtype, 16_384, 5, 300)[:-1]
    itemsize = plane_itemsize(dtype)
    native = planes_native.sample_entropy(lib, memoryview(raw), itemsize)
    planes = plane_kernels.to_planes(memoryview(raw), itemsize)
    expected = [kernels._entropy_bits(np.bincount(p, minlength=256)) for p in planes]
    assert native == pytest.approx(expected, abs=1e-9)
    assert min(native) < kernels.RANDOM_ENTROPY_BITS < max(native)  # both kinds of plane are in the sample


def test_native_chunk_encoder_refuses_too_little_scratch_and_a_bad_element_size(lib) -> None:
    raw = np.frombuffer(_values(torch.float32, 4096, 3, 0)[:-1], dtype=np.uint8)
    out = np.empty(raw.size, dtype=np.uint8)
    with pytest.raises(ValueError, match="scratch of 64 bytes"):
        planes_native.encode_planes(lib, raw, 4, 4096, [False, False, False, True], 4096, out, np.empty(64, np.uint8))
    with pytest.raises(ValueError, match="itemsize 3"):
        planes_native.encode_planes(lib, raw, 3, 4096, [True] * 3, 4096, out, np.empty(1 << 16, np.uint8))
    stored, modes, sizes = planes_native.encode_planes(lib, raw, 4, 4096, [False, False, False, True], 4096, out,
                                                       np.empty(1 << 16, np.uint8))
    assert modes == [kernels.MODE_RAW] * 3 + [kernels.MODE_HUFFMAN] and stored == sum(sizes) < raw.size
