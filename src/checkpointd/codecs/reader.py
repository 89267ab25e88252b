"""Reading the chunked zstd containers of ``compress.py``: the seek table, then chunks decoded in parallel.

``compress.py`` documents the format and writes it; this module reads it. :class:`DecodedReader` is the
seekable stream of native bytes that ``Codec.open_decoded`` returns: a read decodes only the chunks it
covers, in the codec's thread pool, straight into the caller's buffer.
"""

from __future__ import annotations

import bisect
import io
import struct
from collections import deque
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Any, cast

import numpy as np

from checkpointd.codecs import planes as kernels
from checkpointd.codecs.compress import _ENTRY, _FOOTER, _FRAME_HEADER, _SKIPPABLE_INDEX_MAGIC, ZstdCodec
from checkpointd.errors import CorruptCheckpointError
from checkpointd.format.streams import ReadStream, SeekableReader


def _read_index(raw: ReadStream | _ViewFile, footer_magic: int, codec_name: str) -> tuple[list[int], list[int]]:
    """Frame offsets and native offsets (each with a final end offset) from the trailing seek table."""
    end = raw.seek(0, io.SEEK_END)
    hint = f"the {codec_name!r} file is truncated, corrupt, or was not written by checkpointd"
    if end < _FRAME_HEADER.size + _FOOTER.size:
        raise CorruptCheckpointError(f"{hint}: {end} bytes is too short for a seek table")
    raw.seek(end - _FOOTER.size)
    count, descriptor, magic = _FOOTER.unpack(_read_exact(raw, _FOOTER.size, hint))
    if magic != footer_magic or descriptor & 0x7F:
        raise CorruptCheckpointError(f"{hint}: no seek table at the end (magic {magic:#x})")
    entry_size = _ENTRY.size + (4 if descriptor & 0x80 else 0)  # bit 7: per-frame checksums follow
    table_nbytes = _FRAME_HEADER.size + count * entry_size + _FOOTER.size
    if table_nbytes > end:
        raise CorruptCheckpointError(f"{hint}: seek table of {count} frames exceeds the file")
    raw.seek(end - table_nbytes)
    table = memoryview(_read_exact(raw, table_nbytes - _FOOTER.size, hint))
    frame_magic, body_nbytes = _FRAME_HEADER.unpack_from(table)
    if frame_magic != _SKIPPABLE_INDEX_MAGIC or body_nbytes != table_nbytes - _FRAME_HEADER.size:
        raise CorruptCheckpointError(f"{hint}: bad seek table frame header")
    frame_offsets, native_offsets = [0], [0]
    for i in range(count):
        frame_nbytes, native_nbytes = _ENTRY.unpack_from(table, _FRAME_HEADER.size + i * entry_size)
        frame_offsets.append(frame_offsets[-1] + frame_nbytes)
        native_offsets.append(native_offsets[-1] + native_nbytes)
    if frame_offsets[-1] != end - table_nbytes:
        raise CorruptCheckpointError(f"{hint}: frames span {frame_offsets[-1]} bytes, the file {end - table_nbytes}")
    return frame_offsets, native_offsets


def _read_exact(raw: ReadStream | _ViewFile, nbytes: int, hint: str) -> bytes:
    data = raw.read(nbytes)
    if data is None or len(data) != nbytes:
        raise CorruptCheckpointError(f"{hint}: short read ({0 if data is None else len(data)} of {nbytes} bytes)")
    return data


class _ViewFile:
    """``seek``/``read`` over a memoryview, copying only what is read (for the seek table)."""

    def __init__(self, view: memoryview) -> None:
        self._view, self._pos = view, 0

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._pos = offset + (self._view.nbytes if whence == io.SEEK_END else 0)
        return self._pos

    def read(self, nbytes: int) -> bytes:
        data = bytes(self._view[self._pos : self._pos + nbytes])
        self._pos += len(data)
        return data


class DecodedReader(SeekableReader):
    """Seekable stream of a chunked file's native bytes, decoding chunks on the pool.

    A read decodes the chunks it spans and nothing else, so one tensor of a large file loads without
    decoding the rest. Chunks that a read covers whole are decoded by pool tasks straight into their
    slot of the caller's buffer (``max_inflight`` at once); only a chunk that the read covers in part is
    decoded into a chunk buffer of its own, kept for the reads that follow. The calling thread only
    slices frames out of the source and waits: reads of ``raw`` happen on it alone (fsspec files are not
    thread-safe), and an in-memory source (:class:`checkpointd.restore.fastload.BufferReader`, or the bytes
    given to :func:`decode_bytes`) is sliced without any copy.
    """

    def __init__(self, codec: ZstdCodec, raw: ReadStream, source: memoryview | None = None) -> None:
        super().__init__()
        if source is None and callable(getattr(raw, "getbuffer", None)) and not isinstance(raw, io.BytesIO):
            source = memoryview(cast(Any, raw).getbuffer()).cast("B")  # a BytesIO export would pin it open
        if source is None and not (raw.seekable() if hasattr(raw, "seekable") else False):
            raw = io.BytesIO(raw.read())
        self._codec = codec
        self._raw = raw
        self._source = source
        index_file = _ViewFile(source) if source is not None else raw
        self._frames, self._natives = _read_index(index_file, codec._footer_magic, codec.name)
        self._size = self._natives[-1]
        self._pos = 0
        self._futures: dict[int, Future[np.ndarray]] = {}
        self._cached: tuple[int, np.ndarray] | None = None

    def extent(self) -> int:
        return self._size

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        start, stop = self._pos, min(self._size, self._pos + view.nbytes)
        if start >= stop:
            return 0
        dest = np.frombuffer(view, dtype=np.uint8, count=stop - start)
        first = bisect.bisect_right(self._natives, start) - 1
        last = bisect.bisect_left(self._natives, stop) - 1
        for stale in [i for i in self._futures if i < first]:
            self._futures.pop(stale).cancel()
        inflight: deque[tuple[Future[Any], tuple[int, int, int] | None]] = deque()
        try:
            for index in range(first, last + 1):
                lo, hi = self._natives[index], self._natives[index + 1]
                a, b = max(start, lo), min(stop, hi)
                if a >= b:
                    continue
                if self._cached is not None and self._cached[0] == index:
                    kernels.copy_into(dest[a - start : b - start], self._cached[1][a - lo : b - lo])
                    continue
                future = self._futures.pop(index, None)
                if future is None and a == lo and b == hi:  # whole chunk: decode into its slot
                    frame = self._frame(index)
                    out = dest[a - start : b - start]
                    inflight.append((self._codec.executor.submit(self._decode_chunk, index, frame, out), None))
                else:  # part of a chunk: decode the chunk on its own, copy the part, keep it
                    inflight.append((future or self._submit(index), (index, a - lo, b - lo)))
                while len(inflight) >= self._codec.max_inflight:
                    self._finish(inflight.popleft(), dest, start)
            while inflight:
                self._finish(inflight.popleft(), dest, start)
        except BaseException:
            for future, _ in inflight:
                future.cancel()
            wait_futures([f for f, _ in inflight])  # no task may write into ``buffer`` after we return
            raise
        self._pos = stop
        return stop - start

    def _finish(self, item: tuple[Future[Any], tuple[int, int, int] | None], dest: np.ndarray, start: int) -> None:
        future, part = item
        data = future.result()
        if part is not None:
            index, a, b = part
            base = self._natives[index] - start
            kernels.copy_into(dest[base + a : base + b], data[a:b])
            self._cached = (index, data)

    def readall(self) -> bytes:
        out = bytearray(max(0, self._size - self._pos))
        got = self.readinto(out) if out else 0
        return bytes(out[:got]) if got != len(out) else bytes(out)

    def close(self) -> None:
        if not self.closed:
            for future in self._futures.values():
                future.cancel()
            self._futures.clear()
            self._cached = None
            self._source = None
            self._raw.close()
        super().close()

    def _frame(self, index: int) -> memoryview | bytes:
        start, stop = self._frames[index], self._frames[index + 1]
        if self._source is not None:
            frame = self._source[start:stop]
            if frame.nbytes != stop - start:
                raise CorruptCheckpointError(f"chunk {index} of the {self._codec.name!r} file: short buffer")
            return frame
        self._raw.seek(start)
        return _read_exact(self._raw, stop - start, f"chunk {index} of the {self._codec.name!r} file")

    def _submit(self, index: int) -> Future[np.ndarray]:
        """Decode chunk ``index`` into a new array on the pool."""
        frame = self._frame(index)
        out = np.empty(self._natives[index + 1] - self._natives[index], dtype=np.uint8)
        return self._codec.executor.submit(self._decode_chunk, index, frame, out)

    def _decode_chunk(self, index: int, frame: Any, out: np.ndarray) -> np.ndarray:
        try:
            self._codec._decode_into(memoryview(frame), out)
            return out
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(
                f"{self._codec.name!r} chunk {index} (file bytes {self._frames[index]}..{self._frames[index + 1]}): "
                f"{exc}; the file is corrupt, restore another step"
            ) from exc
        except (struct.error, ValueError) as exc:
            raise CorruptCheckpointError(f"{self._codec.name!r} chunk {index} is malformed: {exc}") from exc
