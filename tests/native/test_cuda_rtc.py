"""Runtime-compiled kernels (``cuda_rtc``): the disk cache and the failures, on the CPU.

Compiling and launching need NVRTC and a GPU: ``tests/gpu/test_device_verify_cuda.py`` covers them
(the CRC kernels against zlib, a fresh process loading the stored cubin, a truncated one rebuilt).
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from checkpointd import options
from checkpointd.native import cuda_rtc, kernel_cache
from checkpointd.codecs import device_crc


@pytest.fixture
def fake_nvrtc(monkeypatch, tmp_path):
    """``compile_cubin`` replaced by a counter (the cache logic is what is tested here); the cache and
    the temporary directory inside ``tmp_path``."""
    calls: list[tuple[str, str]] = []

    def compile_cubin(source, arch, options=()):
        calls.append((source, arch))
        return f"cubin:{arch}:{len(calls)}:{source}".encode()
    monkeypatch.setattr(cuda_rtc, "compile_cubin", compile_cubin)
    monkeypatch.setattr(cuda_rtc, "_nvrtc_version", lambda: "12.9")
    monkeypatch.setenv(options.CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    os.makedirs(tmp_path / "tmp")
    return calls


def test_a_compiled_kernel_is_stored_and_loaded_from_the_cache(monkeypatch, tmp_path, fake_nvrtc) -> None:
    first, origin = cuda_rtc._cached_cubin("src A", "90", [])
    assert origin == "compiled" and len(fake_nvrtc) == 1
    stored = os.listdir(tmp_path / "cache")
    assert len(stored) == 1 and stored[0].endswith(".sm_90.cubin")  # no temporary file left behind
    again, origin = cuda_rtc._cached_cubin("src A", "90", [])
    assert (again, origin) == (first, "cache") and len(fake_nvrtc) == 1
    _, origin = cuda_rtc._cached_cubin("src A", "80", [])  # another architecture: its own entry
    assert origin == "compiled" and len(fake_nvrtc) == 2
    _, origin = cuda_rtc._cached_cubin("src B", "90", [])  # changed source: its own entry
    assert origin == "compiled" and len(fake_nvrtc) == 3
    monkeypatch.setattr(cuda_rtc, "_nvrtc_version", lambda: "13.0")  # another compiler: compiled again
    _, origin = cuda_rtc._cached_cubin("src A", "90", [])
    assert origin == "compiled" and len(fake_nvrtc) == 4
    fresh, origin = cuda_rtc._cached_cubin("src A", "90", [], fresh=True)  # a stored cubin that failed to load
    assert origin == "compiled" and len(fake_nvrtc) == 5
    assert cuda_rtc._cached_cubin("src A", "90", [])[0] == fresh  # the rebuilt one replaced it


def test_a_damaged_stored_cubin_is_never_handed_to_the_driver(tmp_path, fake_nvrtc) -> None:
    cuda_rtc._cached_cubin("src", "90", [])
    (stored,) = (tmp_path / "cache").iterdir()
    whole = stored.read_bytes()
    for damaged in (whole[:40], whole[:-1], whole[:-1] + bytes([whole[-1] ^ 1]), b""):
        stored.write_bytes(damaged)
        cubin, origin = cuda_rtc._cached_cubin("src", "90", [])
        assert origin == "compiled" and cubin.startswith(b"cubin:90"), damaged[-8:]
        assert cuda_rtc._cached_cubin("src", "90", [])[1] == "cache"  # stored whole again


def test_a_folder_or_file_others_could_write_is_not_used(tmp_path, fake_nvrtc) -> None:
    cuda_rtc._cached_cubin("src", "90", [])
    (stored,) = (tmp_path / "cache").iterdir()
    stored.chmod(0o666)  # writable by anyone: maybe not ours any more
    assert cuda_rtc._cached_cubin("src", "90", [])[1] == "compiled"
    assert len(list((tmp_path / "tmp").iterdir())) == 1  # kept in the per-user temporary folder instead
    assert cuda_rtc._cached_cubin("src", "90", [])[1] == "cache"
    (tmp_path / "cache").chmod(0o777)
    assert [str(f) for f in kernel_cache.private_folders()] == [str(next((tmp_path / "tmp").iterdir()))]


def test_no_usable_folder_still_compiles(monkeypatch, tmp_path, fake_nvrtc) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"x")  # a file where the folders should be
    monkeypatch.setenv(options.CACHE_DIR_ENV, str(blocker / "sub"))
    monkeypatch.setattr(tempfile, "tempdir", str(blocker))
    cubin, origin = cuda_rtc._cached_cubin("src", "90", [])
    assert origin == "compiled" and cubin.startswith(b"cubin:90")
    assert cuda_rtc._cached_cubin("src", "90", [])[1] == "compiled" and len(fake_nvrtc) == 2


def test_a_missing_library_is_reported_as_unavailable() -> None:
    with pytest.raises(cuda_rtc.KernelUnavailable, match="libcheckpointd-absent.so.1"):
        cuda_rtc._load_library(["libcheckpointd-absent.so.1"], "libcheckpointd-absent.so*")


def test_kernels_need_a_cuda_device() -> None:
    with pytest.raises(cuda_rtc.KernelUnavailable, match="CUDA device"):
        cuda_rtc.kernels(device_crc.KERNEL_SOURCE, ["crc32_lanes"], torch.device("cpu"))
    assert not device_crc.kernel_available(torch.device("cpu"))


def test_a_kernel_that_cannot_be_built_is_tried_once_per_device_and_logged_once(monkeypatch, caplog) -> None:
    calls = []

    def fail(source, names, device, options=()):
        calls.append(device)
        raise cuda_rtc.KernelUnavailable("no NVRTC here (test)")

    monkeypatch.setattr(cuda_rtc.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda_rtc, "kernels", fail)
    monkeypatch.setattr(cuda_rtc, "_failed", {})
    with caplog.at_level("INFO", logger="checkpointd"):
        for _ in range(3):
            assert not cuda_rtc.kernels_available("src", ["k"], torch.device("cuda", 0), "test kernel")
        assert not cuda_rtc.kernels_available("src", ["k"], torch.device("cpu"), "test kernel")
    assert calls == [torch.device("cuda", 0)]
    assert caplog.text.count("no test kernel for cuda:0 (no NVRTC here (test))") == 1
    monkeypatch.setattr(cuda_rtc, "kernels", lambda *a, **k: {"k": object()})
    assert cuda_rtc.kernels_available("src", ["k"], torch.device("cuda", 1), "test kernel")
