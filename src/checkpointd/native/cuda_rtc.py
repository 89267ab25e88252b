"""CUDA C kernels compiled at run time (NVRTC), cached on disk per machine, launched through the driver.

Why not Triton: a restore that verifies on the GPU needs one small kernel (:mod:`checkpointd.codecs.device_crc`),
and Triton's first use in a process costs 0.54-0.56 s with its disk cache warm and 1.19 s cold, plus
0.15-0.26 s to import (H200): more than the kernel saves a resumed job's restore, the only one in its
process. NVRTC ships with every CUDA build of torch (``libnvrtc``, which ``torch.cuda`` itself uses for
jiterator and ``_compile_kernel``) and compiles a kernel this size straight to the device's machine code
(a cubin); the cubin is kept in checkpointd's private cache folder (:mod:`checkpointd.native.kernel_cache`,
:func:`checkpointd.options.cache_dir`), so later processes only load it (``cuModuleLoadData``, ~1 ms).
Launches go through the driver (``cuLaunchKernel``) on torch's current stream, in torch's primary context.

Anything missing (a CPU-only torch, no ``libnvrtc``, an architecture NVRTC does not know, a compile
error) raises :class:`KernelUnavailable`; callers fall back to work that needs no kernel.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import hashlib
import logging
import os
import sys
import tempfile
import threading
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch

from checkpointd.native.kernel_cache import check_private, private_folders

logger = logging.getLogger("checkpointd")


class KernelUnavailable(RuntimeError):
    """A runtime-compiled kernel cannot be built or loaded here; use the path that needs none."""


def _load_library(names: Sequence[str], pattern: str) -> ctypes.CDLL:
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    for entry in sys.path:  # pip's CUDA wheels: site-packages/nvidia/<package>/lib/
        for path in sorted(glob.glob(os.path.join(entry, "nvidia", "*", "lib", pattern)), reverse=True):
            try:
                return ctypes.CDLL(path)
            except OSError:
                continue
    raise KernelUnavailable(f"none of {', '.join(names)} could be loaded (nor {pattern} in a pip CUDA package)")


_libs: dict[str, ctypes.CDLL] = {}
_libs_lock = threading.RLock()  # re-entered: an error inside _in_context's set-up reads its message


def _cuda() -> ctypes.CDLL:
    with _libs_lock:
        if "cuda" not in _libs:
            lib = _load_library(["libcuda.so.1", "libcuda.so"], "libcuda.so*")
            lib.cuModuleLoadData.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
            lib.cuModuleGetFunction.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_char_p]
            lib.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [
                ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
            lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
            lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
            lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
            lib.cuCtxPushCurrent_v2.argtypes = [ctypes.c_void_p]
            lib.cuCtxPopCurrent_v2.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
            _libs["cuda"] = lib
        return _libs["cuda"]


def _nvrtc() -> ctypes.CDLL:
    with _libs_lock:
        if "nvrtc" not in _libs:
            major = (torch.version.cuda or "").split(".")[0]
            names = ([f"libnvrtc.so.{major}"] if major else []) + ["libnvrtc.so"]
            _libs["nvrtc"] = _load_library(names, "libnvrtc.so*[0-9]")
        return _libs["nvrtc"]


def _check_cuda(result: int, what: str) -> None:
    if result != 0:
        msg = ctypes.c_char_p()
        _cuda().cuGetErrorString(result, ctypes.byref(msg))
        raise KernelUnavailable(f"{what} failed: CUDA error {result} ({(msg.value or b'?').decode()})")


def _nvrtc_version() -> str:
    major, minor = ctypes.c_int(), ctypes.c_int()
    _nvrtc().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return f"{major.value}.{minor.value}"


def compile_cubin(source: str, arch: str, options: Sequence[str] = ()) -> bytes:
    """Machine code for ``sm_<arch>`` (e.g. ``"90"``) of the CUDA C ``source`` (no headers, ``extern "C"``)."""
    lib = _nvrtc()
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"checkpointd.cu", 0, None, None)
    if rc != 0:
        raise KernelUnavailable(f"nvrtcCreateProgram failed ({rc})")
    try:
        opts = [f"--gpu-architecture=sm_{arch}".encode(), *(o.encode() for o in options)]
        rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        if rc != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            raise KernelUnavailable(f"NVRTC could not compile for sm_{arch} ({rc}): {log.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        if lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)) != 0 or not size.value:
            raise KernelUnavailable(f"NVRTC gave no machine code for sm_{arch}")
        out = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetCUBIN(prog, out)
        return out.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


_DIGEST = 32
"""A stored cubin is its SHA-256 followed by the cubin: the driver is never handed a truncated or
damaged file (``cuModuleLoadData`` takes no length: it would read a truncated cubin past its end)."""


def _cached_cubin(source: str, arch: str, options: Sequence[str], fresh: bool = False) -> tuple[bytes, str]:
    """``(cubin, where it came from)``: from the first private cache folder that has it
    (:mod:`checkpointd.native.kernel_cache`), else (or ``fresh``) compiled and stored there."""
    key = hashlib.sha256("\0".join([source, arch, _nvrtc_version(), *options]).encode()).hexdigest()[:32]
    name = f"cuda-{key}.sm_{arch}.cubin"
    cubin: bytes | None = None
    for folder in private_folders():
        target = folder / name
        try:
            if not fresh and target.is_file():
                check_private(target)
                stored = target.read_bytes()
                if len(stored) > _DIGEST and hashlib.sha256(stored[_DIGEST:]).digest() == stored[:_DIGEST]:
                    return stored[_DIGEST:], "cache"
                logger.info("stored kernel %s is damaged; compiling it again", target)
            if cubin is None:
                cubin = compile_cubin(source, arch, options)
            fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(hashlib.sha256(cubin).digest() + cubin)
                os.replace(tmp, target)  # whole or absent: processes compiling at once each write a full file
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
            return cubin, "compiled"
        except OSError as exc:  # an unwritable folder, a file that is not private: the next folder
            logger.debug("kernel cache %s not usable (%r)", folder, exc)
    return (cubin if cubin is not None else compile_cubin(source, arch, options)), "compiled"


_contexts: dict[int, int] = {}


def primary_context(index: int) -> int:
    """The handle of device ``index``'s primary context: the one torch's runtime calls use (retained once)."""
    lib = _cuda()
    with _libs_lock:
        ctx = _contexts.get(index)
        if ctx is None:
            dev, handle = ctypes.c_int(), ctypes.c_void_p()
            _check_cuda(lib.cuDeviceGet(ctypes.byref(dev), index), "cuDeviceGet")
            _check_cuda(lib.cuDevicePrimaryCtxRetain(ctypes.byref(handle), dev.value), "cuDevicePrimaryCtxRetain")
            ctx = _contexts[index] = int(handle.value or 0)
    return ctx


def driver_functions(names: Sequence[str]) -> list[int]:
    """The addresses of the CUDA driver's functions ``names`` (for native code that calls them itself)."""
    lib = _cuda()
    out = []
    for name in names:
        try:
            out.append(int(ctypes.cast(getattr(lib, name), ctypes.c_void_p).value or 0))
        except AttributeError as exc:
            raise KernelUnavailable(f"the CUDA driver has no {name}") from exc
    return out


@contextlib.contextmanager
def _in_context(index: int) -> Iterator[None]:
    """The device's primary context (the one torch's runtime calls use) current on this thread.

    Why not ``torch.cuda.device``: it only sets the runtime's device when it differs from the thread's,
    and a thread that never made a runtime call has no current driver context at all."""
    lib = _cuda()
    ctx = primary_context(index)
    _check_cuda(lib.cuCtxPushCurrent_v2(ctypes.c_void_p(ctx)), "cuCtxPushCurrent")
    try:
        yield
    finally:
        lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))


@dataclass
class Kernel:
    """One ``extern "C"`` function of a loaded module (its module stays loaded for the process)."""

    name: str
    func: int
    device: torch.device

    @property
    def index(self) -> int:
        return int(self.device.index or 0)

    def launch(self, grid: int, block: int, args: Sequence[Any], shared_bytes: int = 0) -> None:
        """Queue the kernel on torch's current stream of its device.

        ``args``: CUDA tensors (passed as their data pointers) and ``ctypes`` scalars, in the order of
        the C signature.
        """
        holders: list[Any] = []
        for a in args:
            if isinstance(a, torch.Tensor):
                if a.device != self.device:
                    raise ValueError(f"kernel {self.name}: tensor on {a.device}, expected {self.device}")
                holders.append(ctypes.c_void_p(a.data_ptr()))
            else:
                holders.append(a)
        params = (ctypes.c_void_p * len(holders))(*[ctypes.cast(ctypes.byref(h), ctypes.c_void_p) for h in holders])
        stream = torch.cuda.current_stream(self.device).cuda_stream
        with _in_context(self.index):
            _check_cuda(_cuda().cuLaunchKernel(ctypes.c_void_p(self.func), grid, 1, 1, block, 1, 1, shared_bytes,
                                               ctypes.c_void_p(stream), params, None), f"launching {self.name}")


def _load(cubin: bytes, names: Sequence[str], dev: torch.device) -> dict[str, Kernel]:
    module = ctypes.c_void_p()
    with _in_context(int(dev.index or 0)):
        _check_cuda(_cuda().cuModuleLoadData(ctypes.byref(module), cubin), "cuModuleLoadData")
        out = {}
        for name in names:
            func = ctypes.c_void_p()
            _check_cuda(_cuda().cuModuleGetFunction(ctypes.byref(func), module, name.encode()), f"finding {name}")
            out[name] = Kernel(name, int(func.value or 0), dev)
    return out


_modules: dict[tuple[str, int], dict[str, Kernel]] = {}
_modules_lock = threading.Lock()
load_origin: dict[tuple[str, int], str] = {}
"""How each module got here: ``cache`` (a stored cubin) or ``compiled`` (NVRTC in this process)."""


def kernels(source: str, names: Sequence[str], device: torch.device, options: Sequence[str] = ()) -> dict[str, Kernel]:
    """The ``extern "C"`` kernels ``names`` of ``source``, loaded on ``device`` (once per process and device).

    Raises :class:`KernelUnavailable` where they cannot be built or loaded.
    """
    if device.type != "cuda" or not torch.cuda.is_available():
        raise KernelUnavailable(f"runtime-compiled kernels need a CUDA device, not {device}")
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (hashlib.sha256("\0".join([source, *names, *options]).encode()).hexdigest(), index)
    with _modules_lock:
        if key in _modules:
            return _modules[key]
        dev = torch.device("cuda", index)
        major, minor = torch.cuda.get_device_capability(dev)
        arch = f"{major}{minor}"
        try:
            cubin, origin = _cached_cubin(source, arch, options)
            torch.cuda.init()
            try:
                out = _load(cubin, names, dev)
            except KernelUnavailable:
                if origin != "cache":
                    raise
                logger.info("a stored kernel for sm_%s did not load; compiling it again", arch)
                cubin, origin = _cached_cubin(source, arch, options, fresh=True)
                out = _load(cubin, names, dev)
        except OSError as exc:
            raise KernelUnavailable(f"no NVRTC/driver library here: {exc}") from exc
        _modules[key] = out
        load_origin[("/".join(names), index)] = origin
        return out


_table_streams: dict[int, Any] = {}


def table_to(device: torch.device, table: torch.Tensor) -> torch.Tensor:
    """A small host table (a kernel's arguments, a few host-decoded bytes) on ``device``, for use on the
    current stream, without the host waiting for the device's queued work.

    Why: a copy from pageable memory first waits for everything queued on its stream (on the current
    stream, the kernels of a file decoded just before on another thread), and pinning memory for the
    copy instead blocks the process (holding the GIL) while the driver is busy with a restore's uploads.
    So the copy runs on a stream of its own that holds only such copies; the current stream waits for
    it on the device, and the result is kept until the current stream's work is done with it.
    """
    if device.type != "cuda":
        return table.to(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _libs_lock:
        if index not in _table_streams:
            _table_streams[index] = torch.cuda.Stream(torch.device("cuda", index))
        side = _table_streams[index]
    current = torch.cuda.current_stream(index)
    with torch.cuda.stream(side):
        out = table.to(side.device)
    current.wait_stream(side)
    out.record_stream(current)
    return out


_failed: dict[tuple[str, int], str] = {}


def kernels_available(source: str, names: Sequence[str], device: torch.device, what: str) -> bool:
    """Whether :func:`kernels` can give ``names`` of ``source`` on ``device``: built or loaded on the first
    call; a failure is remembered per device and logged once (``what`` names the kernels in the log)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = ("/".join(names), index)
    with _modules_lock:
        if key in _failed:
            return False
    try:
        kernels(source, names, torch.device("cuda", index))
    except KernelUnavailable as exc:
        with _modules_lock:
            _failed[key] = str(exc)
        logger.info("no %s for cuda:%d (%s)", what, index, exc)
        return False
    return True


__all__ = ["Kernel", "KernelUnavailable", "compile_cubin", "driver_functions", "kernels", "kernels_available",
           "load_origin", "primary_context", "table_to"]
