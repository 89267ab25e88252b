"""Verify on the GPU: a mapped file is uploaded whole to a device image and checksummed there.

Why: a verify-first restore (no byte reaches a live tensor before every file of the step matched its
manifest checksum) checksumming on the host passes over host memory twice, one pass after the other:
the checksum of each file on the CPU (page population + CRC-32: ~70 ms for 4.83 GB on a 16-core H200
host), then the copy into pinned chunks and their DMA into the live tensors (~90 ms). Here the copy
comes first, into a private GPU buffer (the file's *image*, through the pinned bounce chunks of
:mod:`checkpointd.restore.bounce`, whose copy threads fault the mapping's pages in as they read), and the
checksum is computed on the image (:mod:`checkpointd.codecs.device_crc`, 3.3 ms for 4.83 GB on an
H200). The upload runs on native threads holding no GIL where :mod:`checkpointd.native.upload` loads
(49 GB/s against 35 through the Python bounce; the files' parses run beside it). The image is
registered only once the file's checksum matched; the apply then fills the live tensors from it,
device to device (~2 TB/s), and every image is dropped when the restore ends. The bytes checked are
exactly the bytes applied.

When it applies (the default; :func:`checkpointd.options.restore_verify_on` returning ``host`` turns it
off): in a single-process restore (:func:`checkpointd.restore.step.restore_in_place`) into live CUDA
tensors, for an uncompressed mapped file (tmpfs; :func:`checkpointd.restore.fastload.use_mmap`) of at
least :data:`MIN_BYTES`, when the CRC kernels build or load (:mod:`checkpointd.native.cuda_rtc`: NVRTC,
once per machine, ~20 ms; then ~1 ms from the disk cache) and the GPU has room for the image and as
many bytes again (a fresh optimizer's state is allocated by the apply) beside :func:`headroom_bytes`.
Anywhere else, or when anything in the upload or the device checksum fails, the file is checksummed
on the host: the bytes restored are the same either way, and a copy whose stored bytes lie outside
every image (a dtype cast, a CPU tensor) takes the host path from the mapping.

A local ``zstd-planes`` file read by a restore is uploaded and checksummed the same way, then decoded
on the device (:mod:`checkpointd.restore.device_decode`); its image's host holds only the bytes the
host decoded. Every reader of stored values on the host (a copy that is not a device-to-device byte
copy, the per-entry path, an optimizer's ``load_state_dict``, the RNG state, a retry without images)
calls :func:`ensure_host` first, which copies the missing bytes of those tensors back from the device;
a loaded tree it cannot follow (a tensor subclass, an object) gets its whole host copy at once.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol, Sequence

import torch

from checkpointd import options
from checkpointd.codecs import device_crc
from checkpointd.format.streams import byte_view
from checkpointd.restore.bounce import upload_bytes

logger = logging.getLogger("checkpointd")

MIN_BYTES = 1 << 20
"""Smaller files are checksummed on the host: the upload's and the kernel's set-up outweigh the CPU pass."""
HEADROOM_BYTES = 1 << 30
HEADROOM_FRACTION = 0.05
"""Free device memory left beside the image and the apply's own allocations: the larger of 1 GiB and 5 %
of the device's memory (the training's first steps after a resume allocate their activations)."""


def mode() -> str:
    """``device`` (the default) or ``host``: where restored files are checksummed
    (:func:`checkpointd.options.restore_verify_on`).

    Raises:
        ValueError: the setting is neither (the message names it).
    """
    return options.restore_verify_on()


class Decoding(Protocol):
    """A file's decoding on the device, begun by :func:`verify` before the file's checksum is known
    (:class:`checkpointd.restore.device_decode.PlanesDecoding`)."""

    def start(self, device: torch.device) -> None:
        """Called once the image is allocated on ``device``, before the upload."""

    def uploaded(self, data: torch.Tensor) -> None:
        """Called once the file is on the device (``data``) and its checksum's kernels are queued."""


class UploadTurns:
    """The uploads of a restore's files in the caller's order, one after the other: turn ``i`` begins once
    every turn before it has ended, its file uploaded or not uploaded at all (:meth:`end` either way)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._ended: set[int] = set()
        self._next = 0
        """Every turn below this one has ended."""

    def wait(self, i: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._next >= i)

    def end(self, i: int) -> None:
        with self._cond:
            self._ended.add(i)
            while self._next in self._ended:
                self._next += 1
            self._cond.notify_all()


@dataclass(eq=False)
class DeviceImage:
    """A copy of one mapped file on the device, found by the host addresses of the mapping."""

    host: torch.Tensor
    """The mapped file (1-D uint8). Held so that its addresses cannot be reused while the image lives."""
    data: torch.Tensor
    """The same bytes on the device."""
    device_only: list[tuple[int, int]] = field(default_factory=list)
    """Byte ranges ``[start, stop)`` of ``host`` not written yet (a file decoded on the device,
    :mod:`checkpointd.restore.device_decode`): :func:`ensure_host` copies them back from ``data`` before the
    host reads them."""
    unchecked: Callable[[], None] | None = None
    """The device's check of a file it is still decoding (:mod:`checkpointd.restore.device_decode`), not
    taken yet: :meth:`confirm`."""
    planes: Decoding | None = None
    """The decoding on the device of a ``zstd-planes`` file, begun beside its upload (:func:`verify`)."""

    def confirm(self) -> None:
        """Wait for the device's decoding of this image and raise if it found the file damaged (once;
        :func:`register` and every copy back to the host call it first)."""
        check, self.unchecked = self.unchecked, None
        if check is not None:
            check()

    @property
    def start(self) -> int:
        return self.host.data_ptr()

    @property
    def end(self) -> int:
        return self.host.data_ptr() + self.host.numel()


@dataclass(eq=False)
class _Restore:
    device: torch.device
    images: list[DeviceImage] = field(default_factory=list)
    promised: int = 0
    """Bytes of room kept for the apply's allocations of files uploaded so far (one file's size each)."""


_lock = threading.Lock()
_active: list[_Restore] = []
stats: dict[str, int] = {"verified": 0, "verified_bytes": 0, "no_room": 0, "failed": 0, "copies": 0, "copy_bytes": 0,
                         "decoded": 0, "host_filled_bytes": 0}
"""Counters since the process started (tests and benchmarks read them): files checksummed on the device
and their bytes, files left to the host for want of device memory or after a failure in the upload or
the device checksum, copies into live tensors taken from an image and their bytes, compressed files
decoded on the device, and bytes of theirs copied back to the host because the host read them."""


def target_device(objects: Sequence[Any]) -> torch.device | None:
    """The CUDA device of the first live tensor among ``objects`` (modules, optimizers, tensors), else None."""
    for obj in objects:
        for t in _tensors_of(obj):
            if t.device.type == "cuda":
                return t.device if t.device.index is not None else torch.device("cuda", torch.cuda.current_device())
    return None


def _tensors_of(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, torch.nn.Module):
        yield from obj.parameters()
        yield from obj.buffers()
    elif isinstance(obj, torch.optim.Optimizer):
        for group in obj.param_groups:
            yield from (p for p in group["params"] if isinstance(p, torch.Tensor))


def _usable(device: torch.device) -> bool:
    if mode() == "host":
        return False
    if device.type != "cuda":
        return True  # a CPU "device": the bookkeeping's tests (the checksum then runs as torch ops)
    return device_crc.kernel_available(device)  # built (or loaded from the disk cache) here, once per process


@contextlib.contextmanager
def verifying_on(device: torch.device | None) -> Iterator[None]:
    """Within the block, mapped files read for a restore may be verified on ``device`` (None: never).

    Every image made within the block is dropped on leaving it (also after a failure).
    """
    if device is None or not _usable(device):
        yield
        return
    restore = _Restore(device)
    with _lock:
        _active.append(restore)
    try:
        yield
    finally:
        with _lock:
            _active.remove(restore)
        restore.images.clear()


def drop_all() -> bool:
    """Forget every registered image (their memory goes back to the allocator); True if there was one.

    The host bytes of images decoded on the device are copied back first: the host is all that is left.
    """
    with _lock:
        images = [im for r in _active for im in r.images]
    for im in images:
        fill_host(im)
    with _lock:
        had = any(r.images for r in _active)
        for r in _active:
            r.images.clear()
    return had


def verify(buf: torch.Tensor, planes: Decoding | None = None,
           turn: tuple[UploadTurns, int] | None = None) -> tuple[DeviceImage, int] | None:
    """Upload the mapped file ``buf`` to the restore's device and checksum it there: ``(image, CRC-32)``.

    None where that does not apply (no restore verifying on a device, a file below ``MIN_BYTES``, no room)
    or anything failed (logged): the caller checksums on the host instead. The image is not usable
    until :func:`register`-ed, which the caller does only once the CRC matched the manifest.

    ``planes``: the file's decoding on the device, begun here (:class:`Decoding`): started once the image
    is allocated, and told of the upload after the checksum's kernels are queued and before their result
    is read back. ``turn``: ``(turns, i)``, the upload waits for turn ``i`` and ends it.
    """
    data = allocate(buf)
    if data is None:
        return None
    n = data.numel()
    if planes is not None:
        planes.start(data.device)
    try:
        if turn is not None:
            turn[0].wait(turn[1])
        try:
            if data.device.type == "cuda":
                upload_bytes(data, buf)
            else:  # a CPU "device" (tests)
                data.copy_(buf)
        finally:
            if turn is not None:
                turn[0].end(turn[1])
        tail = byte_view(buf)[device_crc.tail_start(n):]  # from the mapping: no copy back from the device
        crc_of = device_crc.crc32_start(data, host_tail=tail)  # the CUDA kernels (``_usable`` built them)
        if planes is not None:
            planes.uploaded(data)
        crc = crc_of()
    except Exception as exc:  # noqa: BLE001 - no pinned memory, a kernel failure: the host pass needs none of it
        logger.warning("restore: verifying a %d-byte file on %s failed (%r); checksumming it on the host", n, data.device, exc)
        count(failed=1)
        return None
    count(verified=1, verified_bytes=n)
    return DeviceImage(buf, data, planes=planes), crc


def count(**deltas: int) -> None:
    """Add to :data:`stats`."""
    with _lock:
        for key, n in deltas.items():
            stats[key] += n


def ensure_host(obj: Any) -> None:
    """Write the host bytes of the tensors in ``obj`` (a loaded tree) that an image decoded on the device
    has not written yet; call it before the host reads them. A tree holding anything but containers,
    plain CPU tensors and scalars makes every such image's host whole."""
    with _lock:
        images = [im for r in _active for im in r.images if im.device_only]
    if not images:
        return
    tensors: list[torch.Tensor] = []
    if not _plain_tree(obj, tensors, set()):
        for im in images:
            fill_host(im)
        return
    for t in tensors:
        storage = t.untyped_storage()
        p, n = storage.data_ptr(), storage.nbytes()
        for im in images:
            if im.start < p + n and p < im.end:
                _fill(im, [(max(p, im.start) - im.start, min(p + n, im.end) - im.start)])


def follows(obj: Any) -> bool:
    """Whether :func:`ensure_host` can find every tensor of ``obj`` (containers, plain tensors, scalars only)."""
    return _plain_tree(obj, [], set())


def fill_host(image: DeviceImage) -> None:
    """Write every byte of ``image``'s host that only its device copy holds."""
    _fill(image, [(0, image.host.numel())])


_SCALARS = (str, bytes, int, float, complex, bool, type(None), torch.Size, torch.dtype, torch.device, torch.layout,
            torch.memory_format)


def _plain_tree(obj: Any, tensors: list[torch.Tensor], seen: set[int]) -> bool:
    """Collect the CPU tensors of ``obj``; False if it holds anything :func:`ensure_host` cannot follow."""
    if isinstance(obj, _SCALARS):
        return True
    if id(obj) in seen:
        return True
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        if type(obj) not in (torch.Tensor, torch.nn.Parameter) or obj.__dict__:
            return False  # a subclass, or attributes set on the tensor
        if obj.device.type == "cpu":
            tensors.append(obj)
        return True
    if isinstance(obj, dict):
        return all(_plain_tree(k, tensors, seen) and _plain_tree(v, tensors, seen) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return all(_plain_tree(v, tensors, seen) for v in obj)
    return False


_fill_lock = threading.Lock()


def _fill(image: DeviceImage, wanted: list[tuple[int, int]]) -> None:
    """Copy the device-only parts of ``wanted`` (byte ranges of ``image``) from the device to the host."""
    image.confirm()
    with _fill_lock:
        left: list[tuple[int, int]] = []
        for a, b in image.device_only:
            for lo, hi in wanted:
                lo, hi = max(a, lo), min(b, hi)
                if lo < hi:
                    image.host[lo:hi].copy_(image.data[lo:hi])
                    with _lock:
                        stats["host_filled_bytes"] += hi - lo
            left += _minus((a, b), wanted)
        image.device_only[:] = left


def _minus(span: tuple[int, int], cuts: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """What is left of ``span`` without the ranges ``cuts``."""
    parts = [span]
    for lo, hi in cuts:
        parts = [q for a, b in parts for q in ((a, min(b, lo)), (max(a, hi), b)) if q[0] < q[1]]
    return parts


def allocate(buf: torch.Tensor, nbytes: int | None = None) -> torch.Tensor | None:
    """The device buffer for an image of ``buf`` (``nbytes``, default its size) where one applies and fits
    (see the module docstring)."""
    with _lock:
        restore = _active[-1] if _active else None
    n = buf.numel() if nbytes is None else nbytes
    if restore is None or buf.device.type != "cpu" or n < max(1, MIN_BYTES):
        return None
    with _lock:  # the room check and the allocation together: files read side by side both count
        if not _has_room(restore, n):
            stats["no_room"] += 1
            return None
        try:
            data = torch.empty(n, dtype=torch.uint8, device=restore.device)
        except torch.OutOfMemoryError:
            stats["no_room"] += 1
            return None
        restore.promised += n
    return data


def _has_room(restore: _Restore, n: int) -> bool:
    if restore.device.type != "cuda":
        return True
    free, total = torch.cuda.mem_get_info(restore.device)
    return free - 2 * n - restore.promised >= headroom_bytes(total)


def headroom_bytes(total: int) -> int:
    """Device memory left free beside an image (see ``HEADROOM_BYTES``)."""
    return max(HEADROOM_BYTES, int(HEADROOM_FRACTION * total))


def register(image: DeviceImage | None) -> None:
    """Make a verified image available to the apply of the restore in progress.

    Raises:
        CorruptCheckpointError: the device found the file damaged while decoding it (:meth:`DeviceImage.confirm`).
    """
    if image is None:
        return
    image.confirm()
    with _lock:
        for restore in _active:
            if restore.device == image.data.device:
                restore.images.append(image)
                return


def take_from_images(items: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device
                     ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[tuple[torch.Tensor, torch.Tensor]]]:
    """Split byte-copy pairs ``(dst, src)`` (1-D uint8) into those whose ``src`` lies in an image on
    ``device`` (returned with the image's bytes as source) and the rest (returned as they are)."""
    with _lock:
        images = [im for r in _active for im in r.images if im.data.device == device]
    if not images:
        return [], items
    found, rest = [], []
    for dst, src in items:
        p, n = src.data_ptr(), src.numel()
        image = next((im for im in images if im.start <= p and p + n <= im.end), None)
        if image is None:
            rest.append((dst, src))
        else:
            off = p - image.start
            found.append((dst, image.data[off:off + n]))
    with _lock:
        stats["copies"] += len(found)
        stats["copy_bytes"] += sum(d.numel() for d, _ in found)
    return found, rest


__all__ = ["Decoding", "DeviceImage", "UploadTurns", "allocate", "count", "drop_all", "ensure_host", "fill_host", "follows", "headroom_bytes", "mode",
           "register", "stats", "take_from_images", "target_device", "verify", "verifying_on"]
