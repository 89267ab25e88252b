"""A positional file's share of a host-budget stream: each chunk written at its records' offsets.

``chunkstream.FileRecords.fill`` runs one :class:`FileFill` per file: every chunk of the file, once it
holds its bytes, is handed to the persist process (where the ring is in shared memory; that process
writes it and starts its writeback) or written on this process's I/O pool, and its slot in the ring is
freed once its bytes are in the file. The CRC-32 of every written range comes back for the caller to
combine into the file's checksum.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from checkpointd.storage import iopool
from checkpointd.save.chunkring import ChunkStreamAborted
from checkpointd.storage.persist_process import PersistProcessError

logger = logging.getLogger("checkpointd")


REMOTE_TASK_BYTES = 8 << 20
"""Bytes per task of a chunk handed to the persist process: a 64 MiB chunk is written by up to 8 of its
threads at once."""


class FileFill:
    """One positional file's chunks, each written once it holds its bytes: by the persist process
    (``remote``) or on this process's I/O pool; a chunk's slot is freed once its bytes are in the file."""

    def __init__(self, stream: Any, pieces: dict[str, Any], put: Callable[[Any, int], None],
                 written: Callable[[int, int], None] | None, remote: Any) -> None:
        self.stream = stream
        self.pieces = pieces
        self.put = put
        self.written = written
        self.remote = remote
        self._cv = threading.Condition()
        self._pending = 0
        """Chunks handed to the process and not yet answered (or handed on to the pool after a failure)."""
        self._results: list[tuple[Any, int, int, int]] = []
        self._local: list[Any] = []
        """Futures of chunks written on the I/O pool."""
        self._errors: list[BaseException] = []
        self._warned = False

    def run(self, chunks: list[Any]) -> list[tuple[Any, int, int, int]]:
        stream = self.stream
        pool = iopool.io_executor()
        first_error: BaseException | None = None
        try:
            for c in chunks:
                if not stream.wait_arrived(c):  # handed on only once it holds data: pool threads never idle-wait
                    raise ChunkStreamAborted("host staging stream aborted") from stream.error
                if self.remote is not None and self._send(c):
                    continue
                future = pool.submit(self._write_here, c)
                with self._cv:
                    self._local.append(future)
        except BaseException as exc:  # noqa: BLE001 - wait for what was handed on first
            first_error = exc
        with self._cv:
            while self._pending:
                self._cv.wait()
            local = list(self._local)
        for f in local:
            try:
                self._results.extend(f.result())
            except BaseException as exc:  # noqa: BLE001
                first_error = first_error or exc
        first_error = first_error or (self._errors[0] if self._errors else None)
        if first_error is not None:
            raise first_error
        return self._results

    # -- here ------------------------------------------------------------------------------------------
    def _write_here(self, c: Any) -> list[tuple[Any, int, int, int]]:
        stream = self.stream
        try:
            stream.await_copied(c)
            pieces = [self.pieces[part.key] for part in c.parts]
            crcs = iopool.put_task(self.put, [(piece.offset + part.start, stream.chunk_view(part))
                                        for piece, part in zip(pieces, c.parts)], self.written)
            out = [(piece, part.start, part.start + part.length, crc) for piece, part, crc in zip(pieces, c.parts, crcs)]
        except BaseException as exc:
            stream.abort(exc)
            raise
        finally:
            if c.arrived:
                stream.consumed(c, len(c.parts))
        return out

    # -- in the persist process -----------------------------------------------------------------------
    def _tasks(self, c: Any) -> tuple[list[list[tuple[int, Any, int, int]]], list[list[tuple[Any, int, int]]]]:
        """The process's tasks for chunk ``c`` (ranges of its slab, about :data:`REMOTE_TASK_BYTES` a
        task), and the ``(piece, start, stop)`` each range is."""
        assert self.stream.ring.slots is not None and c.slot is not None
        slab, base = self.stream.ring.slots[c.slot]
        tasks: list[list[tuple[int, Any, int, int]]] = []
        ranges: list[list[tuple[Any, int, int]]] = []
        filled = REMOTE_TASK_BYTES
        for part in c.parts:
            piece = self.pieces[part.key]
            for pos in range(0, part.length, REMOTE_TASK_BYTES):
                n = min(REMOTE_TASK_BYTES, part.length - pos)
                if filled + n > REMOTE_TASK_BYTES:
                    tasks.append([])
                    ranges.append([])
                    filled = 0
                tasks[-1].append((piece.offset + part.start + pos, slab, base + part.chunk_offset + pos, n))
                ranges[-1].append((piece, part.start + pos, part.start + pos + n))
                filled += n
        return tasks, ranges

    def _send(self, c: Any) -> bool:
        """Hand chunk ``c`` to the process once its copy has landed; False where the process is gone."""
        self.stream.await_copied(c)
        tasks, ranges = self._tasks(c)
        with self._cv:
            self._pending += 1
        try:
            future = self.remote.submit(tasks)
        except BaseException as exc:
            with self._cv:
                self._pending -= 1
                self._cv.notify_all()
            if isinstance(exc, PersistProcessError):
                self._fall_back(exc)
                return False
            raise
        future.add_done_callback(lambda f: self._answered(c, ranges, f))
        return True

    def _fall_back(self, exc: BaseException) -> None:
        self.remote = None
        if not self._warned:
            self._warned = True
            logger.warning("checkpointd: %s; writing the host staging chunks from this process", exc)

    def _answered(self, c: Any, ranges: list[list[tuple[Any, int, int]]], future: Any) -> None:
        """The process's answer for chunk ``c`` (on its reply thread): keep the CRCs and free the slot;
        on the I/O pool instead if the process is gone; the save fails on a write error."""
        released = False
        try:
            exc = future.exception()
            if isinstance(exc, PersistProcessError):
                self._fall_back(exc)
                local = iopool.io_executor().submit(self._write_here, c)  # frees the slot when written
                released = True
                with self._cv:
                    self._local.append(local)
                return
            if exc is not None:
                raise exc
            out = [(piece, a, b, crc) for task, crcs in zip(ranges, future.result()) for (piece, a, b), crc in zip(task, crcs)]
            with self._cv:
                self._results.extend(out)
        except BaseException as err:  # noqa: BLE001 - the file thread raises it
            self.stream.abort(err)
            with self._cv:
                self._errors.append(err)
        finally:
            if not released:
                self.stream.consumed(c, len(c.parts))
            with self._cv:
                self._pending -= 1
                self._cv.notify_all()
