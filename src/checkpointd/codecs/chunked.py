"""The chunked encoder shared by the codecs: a write stream cut into chunks, encoded on a pool, written in order.

Standard library, NumPy, :mod:`checkpointd.codecs.container` and what an encode function imports only (no torch):
the persist process (:mod:`checkpointd.storage.persist_process_main`) encodes with it too. A codec gives
an ``encode(view, hint)`` function returning one chunk's frame as parts, the frames that open the file
and its seek table's footer magic (:mod:`checkpointd.codecs.compress` documents both codecs).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Executor, Future
from typing import Any, Protocol

from checkpointd.codecs.container import seek_table
from checkpointd.codecs.frame_buffers import FRAME_BUFFERS

DIRECT_MIN_BYTES = 64 << 10
"""Writes at least this big are chunked zero-copy; smaller ones are copied into a shared chunk."""


class WriteSink(Protocol):
    """Where encoded bytes go (a checksumming file wrapper in the writer)."""

    def write(self, data: memoryview, /) -> Any: ...


class ChunkedEncoder:
    """Cuts a write stream into chunks, encodes them on ``executor``, writes their frames in order to ``out``.

    Called from one thread (the file's writer). Small writes (zip headers, small tensors) are copied into
    a pending chunk; large ones are cut zero-copy at 16-byte boundaries and carry the current
    ``dtype_hint``, which ``encode`` receives with each of their chunks (pending chunks get None). At most
    ``max_inflight`` chunks wait at once. Buffers of :data:`DIRECT_MIN_BYTES` or more must stay unchanged
    until :meth:`close` (or :meth:`drain`) returns.
    """

    def __init__(self, encode: Callable[[memoryview, Any], list[Any]], out: WriteSink, *, chunk_bytes: int,
                 executor: Executor, max_inflight: int, footer_magic: int, preamble: Iterable[bytes] = ()) -> None:
        self._encode = encode
        self._out = out
        self._chunk_bytes = chunk_bytes
        self._executor = executor
        self._max_inflight = max_inflight
        self._footer_magic = footer_magic
        self._inflight: deque[tuple[Future[list[Any]], int]] = deque()
        self._pending = bytearray()
        self._entries: list[tuple[int, int]] = []
        self._closed = False
        self.dtype_hint: Any = None
        self.native_nbytes = 0
        """Bytes written into the encoder so far."""
        self._buffers = FRAME_BUFFERS.open(self)  # frame buffers are reused while this encoder is open
        for frame in preamble:
            self._emit([frame], 0)

    def write(self, data: Any, /) -> int:
        if self._closed:
            raise ValueError("write to a closed encoder")
        view = memoryview(data).cast("B")
        self.native_nbytes += view.nbytes
        if view.nbytes < DIRECT_MIN_BYTES:
            self._pending += view
            if len(self._pending) >= self._chunk_bytes:
                self._flush_pending()
            return view.nbytes
        self._flush_pending()
        for piece in _split(view, self._chunk_bytes):
            self._submit(piece, self.dtype_hint)
        return view.nbytes

    def write_frames(self, data: Any, frames: Iterable[tuple[int, int, int]]) -> None:
        """Chunk frames encoded elsewhere (:mod:`checkpointd.codecs.encode_device`), in stream order:
        ``(offset in data, frame bytes, native bytes)`` each. ``data`` stays unchanged until :meth:`close`."""
        view = memoryview(data).cast("B")
        self._flush_pending()
        for at, size, native in frames:
            done: Future[list[Any]] = Future()
            done.set_result([view[at : at + size]])
            self.native_nbytes += native
            self._inflight.append((done, native))
        while self._inflight and self._inflight[0][0].done():
            self._drain_one()

    def drain(self) -> None:
        """Wait until no buffer passed to :meth:`write` is referenced any more (encoded and written).

        For callers that reuse their buffers before ``close()`` (host-budget staging chunks).
        """
        while self._inflight:
            self._drain_one()

    def close(self) -> None:
        """Write every remaining frame and the seek table; ``out`` stays open."""
        if self._closed:
            return
        self._flush_pending()
        while self._inflight:
            self._drain_one()
        self._closed = True
        write_all(self._out, memoryview(seek_table(self._entries, self._footer_magic)))
        self._buffers()

    def _flush_pending(self) -> None:
        if self._pending:
            chunk, self._pending = self._pending, bytearray()
            self._submit(memoryview(chunk), None)

    def _submit(self, piece: memoryview, hint: Any) -> None:
        future = self._executor.submit(self._encode, piece, hint)
        self._inflight.append((future, piece.nbytes))
        while self._inflight and (len(self._inflight) > self._max_inflight or self._inflight[0][0].done()):
            self._drain_one()

    def _drain_one(self) -> None:
        future, native_nbytes = self._inflight.popleft()
        self._emit(future.result(), native_nbytes)

    def _emit(self, parts: list[Any], native_nbytes: int) -> None:
        frame_nbytes = 0
        for part in parts:
            view = memoryview(part).cast("B")
            write_all(self._out, view)
            frame_nbytes += view.nbytes
        self._entries.append((frame_nbytes, native_nbytes))


def chunk_bounds(nbytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """Where a write of ``nbytes`` is cut: near-equal pieces of at most ~``chunk_bytes``, at multiples of 16
    (any element size)."""
    count = -(-nbytes // chunk_bytes)
    step = -(-nbytes // (count * 16)) * 16 if count > 1 else nbytes
    return [(a, min(nbytes, a + step)) for a in range(0, nbytes, step)]


def _split(view: memoryview, chunk_bytes: int) -> Iterable[memoryview]:
    return (view[a:b] for a, b in chunk_bounds(view.nbytes, chunk_bytes))


def write_all(out: WriteSink, view: memoryview) -> None:
    """``out.write`` until all of ``view`` is taken (raw files may take part of a buffer)."""
    while view.nbytes:
        written = out.write(view)
        if written is None or written >= view.nbytes:
            return
        view = view[written:]


__all__ = ["DIRECT_MIN_BYTES", "ChunkedEncoder", "WriteSink", "chunk_bounds", "write_all"]
