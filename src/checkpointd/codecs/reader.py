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
from concurrent.futures import Executor, Future
from concurrent.futures import wait as wait_futures
from typing import Any, Protocol, cast

import numpy as np

from checkpointd.codecs.container import ViewFile, read_exact, read_index
from checkpointd.codecs.zstd_frames import copy_into
from checkpointd.errors import CorruptCheckpointError
from checkpointd.format.streams import ReadStream, SeekableReader


class ChunkedCodec(Protocol):
    """What a reader needs of a chunked codec (:class:`checkpointd.codecs.compress.ZstdCodec` and its kind)."""

    @property
    def name(self) -> str: ...

    @property
    def footer_magic(self) -> int: ...

    @property
    def executor(self) -> Executor: ...

    @property
    def max_inflight(self) -> int: ...

    def decode_into(self, frame: memoryview, out: np.ndarray) -> None: ...


class DecodedReader(SeekableReader):
    """Seekable stream of a chunked file's native bytes, decoding chunks on the pool.

    A read decodes the chunks it spans and nothing else, so one tensor of a large file loads without
    decoding the rest. Chunks that a read covers whole are decoded by pool tasks straight into their
    slot of the caller's buffer (``max_inflight`` at once); only a chunk that the read covers in part is
    decoded into a chunk buffer of its own, kept for the reads that follow. The calling thread only
    slices frames out of the source and waits: reads of ``raw`` happen on it alone (fsspec files are not
    thread-safe), and an in-memory source (any stream with a ``getbuffer()`` other than ``BytesIO``, such as
    a restore's buffer reader, or the bytes given to :func:`checkpointd.codecs.compress.decode_bytes`) is
    sliced without any copy.
    """

    def __init__(self, codec: ChunkedCodec, raw: ReadStream, source: memoryview | None = None) -> None:
        super().__init__()
        if source is None and callable(getattr(raw, "getbuffer", None)) and not isinstance(raw, io.BytesIO):
            source = memoryview(cast(Any, raw).getbuffer()).cast("B")  # a BytesIO export would pin it open
        if source is None and not (raw.seekable() if hasattr(raw, "seekable") else False):
            raw = io.BytesIO(raw.read())
        self._codec = codec
        self._raw = raw
        self._source = source
        index_file = ViewFile(source) if source is not None else raw
        self._frames, self._natives = read_index(index_file, codec.footer_magic, codec.name)
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
                    copy_into(dest[a - start : b - start], self._cached[1][a - lo : b - lo])
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
            copy_into(dest[base + a : base + b], data[a:b])
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
        return read_exact(self._raw, stop - start, f"chunk {index} of the {self._codec.name!r} file")

    def _submit(self, index: int) -> Future[np.ndarray]:
        """Decode chunk ``index`` into a new array on the pool."""
        frame = self._frame(index)
        out = np.empty(self._natives[index + 1] - self._natives[index], dtype=np.uint8)
        return self._codec.executor.submit(self._decode_chunk, index, frame, out)

    def _decode_chunk(self, index: int, frame: Any, out: np.ndarray) -> np.ndarray:
        try:
            self._codec.decode_into(memoryview(frame), out)
            return out
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(
                f"{self._codec.name!r} chunk {index} (file bytes {self._frames[index]}..{self._frames[index + 1]}): "
                f"{exc}; the file is corrupt, restore another step"
            ) from exc
        except (struct.error, ValueError) as exc:
            raise CorruptCheckpointError(f"{self._codec.name!r} chunk {index} is malformed: {exc}") from exc


__all__ = ["ChunkedCodec", "DecodedReader"]
