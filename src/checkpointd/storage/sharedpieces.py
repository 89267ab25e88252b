"""Which pieces of a file the persist process writes, and the requests that have it write them.

Records staged in shared memory (:mod:`checkpointd.storage.sharedmem`, the default on Linux) are not
written by the training process at all: :class:`SharedPieces` hands their ranges to the persist process
(:mod:`checkpointd.storage.persist_process`), which fills the file from its own threads (its GIL, page
faults and memory-map lock are not the training's) and returns the slice CRCs. Small pieces (the
pickle, small members) are checksummed here and sent with the generated headers in one request at the
end. Whatever the process cannot take is written by this process instead (logged): slower, never lost.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from checkpointd.codecs.crc import crc32
from checkpointd.storage import fsinfo
from checkpointd.storage import persist_process
from checkpointd.storage import sharedmem
from checkpointd.storage.iopool import plan_tasks
from checkpointd.storage.writemode import persist_mode
from checkpointd.storage.ziplayout import LARGE_RECORD_BYTES, Piece

logger = logging.getLogger("checkpointd")


class SharedPieces:
    """Splits a file's pieces between the persist process and this process.

    ``tasks``: pieces staged in shared memory, in write tasks, written by the process from the slabs.
    ``small``: other pieces under :data:`LARGE_RECORD_BYTES` (the pickle, small members), checksummed
    here and sent with the generated headers in one :meth:`scatter` request at the end. ``local``: the
    rest (large and not staged), written by this process's threads. Without a persist process every
    piece is local.
    """

    def __init__(self, pieces: list[Piece], chunk_bytes: int, streamed: bool = False) -> None:
        """``streamed``: the file has members whose bytes arrive later (:meth:`attach`), so it goes
        through the process when one runs, whatever its known pieces are."""
        self.process = None
        self.tasks: list[list[tuple[Piece, int, int]]] = []
        self.small: list[Piece] = []
        """Small known pieces (with a process): CRC'd here at once, written with the headers by :meth:`scatter`."""
        self.slabs: dict[int, Any] = {}
        where: dict[int, tuple[Any, int]] = {}
        shared = sharedmem.supported()
        if shared:
            for p in pieces:
                found = sharedmem.locate(p.data) if p.length >= LARGE_RECORD_BYTES else None
                if found is not None:
                    where[id(p)] = found
                    self.slabs[found[0].id] = found[0]
        all_small = bool(pieces) and all(p.length < LARGE_RECORD_BYTES for p in pieces)
        if where or (shared and (all_small or streamed)):  # a small file with nothing staged: its headers go there too
            self.process = persist_process.client()
        if self.process is None:
            self.local = plan_tasks(pieces, chunk_bytes)
            return
        self.tasks = plan_tasks([p for p in pieces if id(p) in where], chunk_bytes)
        rest = [p for p in pieces if id(p) not in where]
        self.small = [p for p in rest if 0 < p.length < LARGE_RECORD_BYTES]
        for p in self.small:
            p.crc = crc32(p.data)
        self.local = plan_tasks([p for p in rest if p.length >= LARGE_RECORD_BYTES], chunk_bytes)
        self.ranges = [[(p.offset + a, where[id(p)][0].id, where[id(p)][1] + a, b - a) for p, a, b in task]
                       for task in self.tasks]

    def submit(self, fd: int, end: int, mode: str | None, writeback: bool = False) -> Any:
        """Send the tasks; ``mode`` as :func:`checkpointd.storage.ptlayout.write_image`'s (None: a mapping on
        memory file systems); ``writeback``: the process starts the disk on each range it has written
        (:func:`checkpointd.storage.fsinfo.early_writeback`)."""
        chosen, lanes = persist_mode(fd, mode)
        assert self.process is not None
        try:
            return self.process.submit_write(fd, end, chosen, lanes, self.ranges, list(self.slabs.values()), writeback)
        except persist_process.PersistProcessError as exc:
            failed: Future[Any] = Future()
            failed.set_exception(exc)
            return failed

    def attach(self, fd: int, end: int, mode: str | None, writeback: bool) -> Any:
        """The file attached to the persist process for bytes that arrive later in shared memory (a host
        budget's chunks), or None without a process (or when it cannot take it: logged)."""
        if self.process is None:
            return None
        chosen, lanes = persist_mode(fd, mode)
        try:
            return self.process.attach(fd, end, chosen, lanes, writeback)
        except persist_process.PersistProcessError as exc:
            logger.warning("checkpointd: %s; writing those bytes from this process", exc)
            return None

    def scatter(self, fd: int, generated: list[Piece]) -> None:
        """Write the small pieces and the ``generated`` ones (headers, trailer) through the process in
        one request, adjacent pieces joined; here with ``pwrite`` if the process could not."""
        runs: list[tuple[int, bytearray]] = []
        for p in sorted((p for p in [*self.small, *generated] if p.length), key=lambda p: p.offset):
            if runs and runs[-1][0] + len(runs[-1][1]) == p.offset:
                runs[-1][1].extend(p.data)
            else:
                runs.append((p.offset, bytearray(p.data)))
        try:
            assert self.process is not None
            self.process.submit_scatter(fd, [(offset, bytes(data)) for offset, data in runs]).result()
            return
        except persist_process.PersistProcessError as exc:
            logger.warning("checkpointd: %s; writing those bytes from this process", exc)
        for offset, data in runs:
            fsinfo.pwrite_all(fd, data, offset)

    def finish(self, future: Any, run_here: Callable[[list[list[tuple[Piece, int, int]]]], list[Any]]) -> dict[int, Any]:
        """The tasks' CRCs by ``id(task)``; written by ``run_here`` if the process could not."""
        try:
            crcs = future.result()
        except persist_process.PersistProcessError as exc:
            logger.warning("checkpointd: %s; writing those bytes from this process", exc)
            crcs = run_here(self.tasks)
        return dict(zip(map(id, self.tasks), crcs))


__all__ = ["SharedPieces"]
