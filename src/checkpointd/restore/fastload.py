"""Fast restore of local files: parallel verified reads into one buffer, tensors built on that buffer.

Why: the plain path reads a file into Python ``bytes`` on one thread, checksums it on one thread, and
``torch.load`` copies every record out of a ``BytesIO`` into new storages: three passes over the bytes
before ``load_state_dict`` copies them a fourth time into the live tensors. Here:

1. the file is read with ``os.preadv`` in chunks from the shared I/O pool into one preallocated
   buffer, each chunk's CRC-32 computed by the thread that read it while the chunk is in cache; the
   chunk CRCs are combined (:mod:`checkpointd.codecs.crc`) and compared with the manifest *before* anything
   is parsed or applied;
2. compressed files are decoded chunk-parallel (the codec's seek table) straight into a native buffer;
3. only then, the ``.pt`` pickle is run by torch's weights-only unpickler with every storage a
   zero-copy slice of that buffer (torch's own ``mmap=True`` mechanism, fed our verified buffer
   instead of a mapping);
   ``.mdlus`` files load their ``model.pt`` member the same way, in place.

So a restore is: one read into memory, then the copy into the live tensors. Anything unusual (a
record that is compressed inside the zip, a private torch API that moved, an unsafe or damaged pickle)
falls back to :func:`checkpointd.restore.step.load_native` on the same verified bytes, which gives the
usual errors (``UnsafeCheckpointError``, ``CorruptCheckpointError``).
"""

from __future__ import annotations

import functools
import logging
import mmap
import os
import stat
import struct
import zipfile
from typing import Any, Callable, cast

import torch

from checkpointd.storage import iopool
from checkpointd.codecs.checksum import format_crc
from checkpointd.codecs.compress import get_codec
from checkpointd.codecs.crc import crc32, crc32_combine
from checkpointd.errors import CorruptCheckpointError
from checkpointd.format.mdlus import MODEL_MEMBER
from checkpointd.format.streams import SeekableReader, byte_view
from checkpointd.storage import pagemem
from checkpointd.storage.localpaths import kind_of

logger = logging.getLogger("checkpointd")

READ_CHUNK_BYTES = 8 << 20
_CRC_SLICE = 1 << 20


class BufferReader(SeekableReader):
    """A seekable binary stream over a memoryview (no copy until ``readinto``)."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view = view
        self._pos = 0

    def extent(self) -> int:
        return self._view.nbytes

    def getbuffer(self) -> memoryview:
        """The whole underlying view, zero-copy (codecs slice compressed frames out of it)."""
        return self._view

    def readinto(self, b: Any) -> int:
        out = memoryview(b).cast("B")
        n = max(0, min(out.nbytes, self._view.nbytes - self._pos))
        out[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n


def _read_task(fd: int, view: memoryview, start: int, stop: int) -> int:
    """Read file bytes ``[start, stop)`` into ``view[start:stop]``; CRC-32 slice by slice as they land."""
    crc = 0
    pos = start
    while pos < stop:
        end = min(stop, pos + _CRC_SLICE)
        part = view[pos:end]
        got = 0
        while got < part.nbytes:
            n = os.preadv(fd, [part[got:]], pos + got)
            if n <= 0:
                raise EOFError(f"file ended at byte {pos + got}")
            got += n
        crc = crc32(part, crc)
        pos = end
    return crc


MMAP_MIN_BYTES = 64 << 20
"""Files on tmpfs/ramfs at least this big are mapped instead of read when this process uses CUDA
(:func:`use_mmap`)."""
_MEMORY_FS = ("tmpfs", "ramfs")


def _fs_type(path: str) -> str | None:
    """The file system type of ``path`` from /proc/self/mounts (longest mount point prefix)."""
    try:
        real = os.path.realpath(path)
        best, kind = "", None
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, kind = mnt, parts[2]
        return kind
    except OSError:
        return None


def use_mmap(path: str, size: int) -> bool:
    """Map rather than read: on a memory file system the pages are already in RAM.

    Why: reading into freshly allocated memory is bound by page faults (each new page is zeroed,
    then overwritten): measured 8 GB/s on a 16-core H200 host against 43 GB/s into touched memory. A
    private mapping of a tmpfs file costs neither the zeroing nor the copy; writes (to tensors that
    stay on CPU and view the buffer) go to private copies of the pages, never to the file.
    """
    if size == 0:
        return False
    # Only where the values go on to a GPU. On CPU-only runs restored optimizer state views the
    # buffer; a mapping would keep the file's pages alive (after retention deletes it) beside the
    # private copies that training writes. A process whose state lives on a GPU has brought up CUDA
    # by the time it restores (its tensors were made there); one that trains on the CPU of a CUDA host
    # has not, and reads (deciding by ``is_available()`` would map there too).
    return size >= MMAP_MIN_BYTES and process_uses_cuda() and _fs_type(path) in _MEMORY_FS


def process_uses_cuda() -> bool:
    """Whether this process has brought up CUDA (made a tensor there), not only whether it could."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


MAP_CRC_BYTES = 32 << 20
"""A mapped file is checksummed in ranges of this size, one CRC call each. Each call drops and retakes
the GIL, and with 16 threads each retake waits its turn: on a 16-core H200 host 4.8 GB took 84 ms in
1 MiB calls over 8 MiB ranges, 64 ms in one call per 32 MiB range. (Reads keep 1 MiB slices: there the
CRC follows each slice's read while the slice is in cache.)"""


def _crc_task(buf: torch.Tensor, view: memoryview, start: int, stop: int) -> int:
    """CRC-32 of the mapped bytes ``[start, stop)`` in one call, populating the range's page tables first."""
    pagemem.populate_read(buf.data_ptr() + start, stop - start)
    return crc32(view[start:stop], 0)


def _map_file(fd: int, size: int) -> torch.Tensor:
    """A private, copy-on-write mapping of the file as a uint8 tensor (unmapped when the tensor dies).

    Released in pieces (:class:`checkpointd.storage.pagemem.PiecewiseReleasedMap`): the buffer dies off the
    training thread after a restore, and a multi-GB unmap in one go would hold up that thread's next
    thread start, large allocation or page fault for tens of milliseconds.
    """
    m = pagemem.PiecewiseReleasedMap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return torch.frombuffer(m, dtype=torch.uint8)  # holds a reference to the mapping


def open_regular(path: str, where: str) -> int:
    """A read-only descriptor of ``path``, which must be a regular file and not a symbolic link.

    Opened non-blocking, so that a FIFO or device planted in place of a checkpoint file is refused
    instead of blocking the restore forever; the flag is cleared before the descriptor is used.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        CorruptCheckpointError: a link, a directory or anything else that is not a regular file.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise
    except OSError as exc:  # ELOOP: a symbolic link; EISDIR, ENXIO (a socket), ...
        raise CorruptCheckpointError(f"{where} is not a regular file ({exc.strerror}); the checkpoint is damaged") from exc
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise CorruptCheckpointError(f"{where} is not a regular file (a {kind_of(mode)}); the checkpoint is damaged")
    os.set_blocking(fd, True)
    return fd


def read_file_verified(path: str, expected_size: int, where: str,
                       device_verify: Callable[[torch.Tensor], int | None] | None = None) -> tuple[torch.Tensor, int, str]:
    """``(buffer, size, checksum)``: the whole file in a uint8 tensor, read and checksummed in parallel.

    The caller compares size and checksum with the manifest before using the buffer: nothing here
    parses it. When the file's size differs from ``expected_size`` nothing is read (checksum ``""``).
    Files on a memory file system are mapped instead of read (:func:`use_mmap`); the checksum covers
    the mapped bytes.

    ``device_verify(buffer)``, for a mapped file only, may return the file's CRC-32 computed elsewhere
    (:func:`checkpointd.restore.device_image.verify`: on the GPU, from an upload of the mapping); the host
    checksum is then skipped. None: the host checksums as usual.

    Raises:
        FileNotFoundError: missing.
        CorruptCheckpointError: not a regular file (:func:`open_regular`).
    """
    fd = open_regular(path, where)
    try:
        size = os.fstat(fd).st_size
        if size != expected_size:
            return torch.empty(0, dtype=torch.uint8), size, ""
        mapped = use_mmap(path, size)
        step = MAP_CRC_BYTES if mapped else READ_CHUNK_BYTES
        ranges = [(a, min(size, a + step)) for a in range(0, size, step)]
        if mapped:
            buf = _map_file(fd, size)
            crc = device_verify(buf) if device_verify is not None else None
            if crc is not None:
                return buf, size, format_crc(crc)
            view = byte_view(buf)
            crcs = iopool.run_tasks([functools.partial(_crc_task, buf, view, a, b) for a, b in ranges])
        else:
            buf = torch.empty(size, dtype=torch.uint8)
            view = byte_view(buf)
            crcs = iopool.run_tasks([functools.partial(_read_task, fd, view, a, b) for a, b in ranges])
    finally:
        os.close(fd)
    crc = 0
    for (a, b), c in zip(ranges, crcs):
        crc = crc32_combine(crc, c, b - a)
    return buf, size, format_crc(crc)


def decode_to_buffer(codec_name: str, stored: torch.Tensor, native_size: int | None) -> torch.Tensor:
    """Decode a verified compressed file into a fresh native buffer (chunks decode in parallel)."""
    view = byte_view(stored)
    # a BufferReader in gives a SeekableReader out (a DecodedReader, or the BufferReader itself)
    with cast(SeekableReader, get_codec(codec_name).open_decoded(BufferReader(view))) as src:
        if native_size is None:
            native_size = src.seek(0, 2)
            src.seek(0)
        out = torch.empty(native_size, dtype=torch.uint8)
        dest = byte_view(out)
        got = 0
        while got < native_size:
            n = src.readinto(dest[got:])
            if not n:
                raise EOFError(f"decoded stream ended at {got} of {native_size} bytes")
            got += n
        if src.read(1):
            raise ValueError(f"decoded stream is longer than {native_size} bytes")
    return out


# -- building tensors on the buffer ------------------------------------------------------------------


def load_pt_in_place(buf: torch.Tensor) -> Any:
    """Unpickle a verified ``.pt`` file held in ``buf`` (1-D uint8, CPU) with storages sliced from ``buf``.

    The pickle is run by torch's own weights-only unpickler (what ``torch.load(weights_only=True)``
    runs), so this accepts exactly what that accepts: no code runs, no object outside its allow-list
    is built or changed. Raises whatever torch raises; callers fall back to the plain loader for their
    error messages.
    """
    from torch import _weights_only_unpickler
    from torch.serialization import _load

    storage = buf.untyped_storage()
    offset = buf.storage_offset()
    if offset or storage.nbytes() != buf.numel():
        storage = storage[offset:offset + buf.numel()]
    reader = torch._C.PyTorchFileReader(BufferReader(byte_view(buf)))  # type: ignore[call-overload]  # stub: IO[bytes] only
    return _load(reader, "cpu", _weights_only_unpickler, overall_storage=storage, encoding="utf-8")


_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")


def stored_member(buf: torch.Tensor, name: str) -> torch.Tensor:
    """The bytes of a stored (uncompressed) zip member of ``buf``, as a slice of ``buf``."""
    view = byte_view(buf)
    with zipfile.ZipFile(BufferReader(view)) as zf:
        info = zf.getinfo(name)
    if info.compress_type != zipfile.ZIP_STORED:
        raise ValueError(f"{name} is compressed inside the zip")
    sig, *_rest, name_len, extra_len = _LOCAL_HEADER.unpack_from(view, info.header_offset)
    if sig != 0x04034B50:
        raise zipfile.BadZipFile(f"bad local header for {name}")
    start = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
    if start + info.file_size > view.nbytes:
        raise zipfile.BadZipFile(f"{name} runs past the end of the file")
    return buf[start:start + info.file_size]


def load_native_in_place(buf: torch.Tensor, fmt: str) -> Any:
    """Content of a native ``.pt``/``.mdlus`` file held in ``buf``, tensors viewing ``buf``."""
    if fmt == "mdlus":
        state = load_pt_in_place(stored_member(buf, MODEL_MEMBER))
        if not isinstance(state, dict):
            raise TypeError("model.pt does not hold a state dict")
        return state
    return load_pt_in_place(buf)


__all__ = ["BufferReader", "decode_to_buffer", "load_native_in_place", "load_pt_in_place", "read_file_verified"]
