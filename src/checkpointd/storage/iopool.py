"""The shared I/O thread pool, and the write tasks that run on it.

Positional reads and writes of every file of every save share one pool (:func:`io_executor`) of
:func:`io_threads` threads. A file's bytes are cut into tasks of about a chunk (:func:`plan_tasks`);
each task puts its ranges into the file slice by slice, computing each slice's CRC-32 on the same
thread just before the slice is put, while it is in cache (:func:`put_task`): every byte is read once,
by the thread that writes it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any

from checkpointd import options
from checkpointd.codecs.crc import crc32
from checkpointd.storage.lanes import run_in_lanes
from checkpointd.storage.ziplayout import Piece

DEFAULT_CHUNK_BYTES = 8 << 20
"""Bytes per write task."""
CRC_SLICE_BYTES = 1 << 20
"""Within a task, CRC then write this much at a time, so the write reads the bytes from cache."""

_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_in_pool = threading.local()


def _mark_pool_thread() -> None:
    _in_pool.flag = True


def io_threads() -> int:
    """The I/O pool's size (:func:`checkpointd.options.io_threads`)."""
    return options.io_threads()


def io_executor() -> ThreadPoolExecutor:
    """The shared pool for positional reads and writes (:func:`io_threads` threads).

    Tasks on it never wait on other tasks of it, so files of one save (each driven from a writer
    thread) and the chunks within them share it without deadlock.
    """
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=io_threads(), thread_name_prefix="checkpointd-io",
                                       initializer=_mark_pool_thread)
        return _pool


def in_io_pool() -> bool:
    """Whether the calling thread is one of :func:`io_executor`'s."""
    return bool(getattr(_in_pool, "flag", False))


def run_tasks(fns: list[Callable[[], Any]], executor: Executor | None = None, lanes: int | None = None,
              meanwhile: Callable[[], None] | None = None) -> list[Any]:
    """Run ``fns`` on the pool (inline when called from one of its threads); results in order.

    ``lanes``: at most this many of ``fns`` run at once (each lane runs the next task when its
    current one ends), so that several callers share the pool instead of the first queueing all of
    its tasks ahead of the others. On the first failure, tasks not yet started are cancelled (or
    skipped), running ones are waited for, and the failure is raised. ``meanwhile``: run on the
    calling thread while the tasks run (ahead of them when they run inline), exactly once.
    """
    if not fns or len(fns) == 1 or (executor is None and in_io_pool()):
        if meanwhile is not None:
            meanwhile()
        return [fn() for fn in fns]
    pool = executor or io_executor()
    if lanes is not None and 0 < lanes < len(fns):
        if meanwhile is not None:
            meanwhile()
        return run_in_lanes(fns, pool, lanes)
    futures: list[Future[Any]] = [pool.submit(fn) for fn in fns]
    try:
        if meanwhile is not None:
            meanwhile()
        return [f.result() for f in futures]
    except BaseException:
        for f in futures:
            f.cancel()
        for f in futures:
            if not f.cancelled():
                try:
                    f.exception()
                except BaseException:  # noqa: BLE001 - waiting only
                    pass
        raise


def put_task(put: Callable[[Any, int], None], work: list[tuple[int, Any]],
             written: Callable[[int, int], None] | None = None) -> list[int]:
    """Put ``(offset, view)`` pieces into the file with ``put(slice, offset)``, CRC-32 of each slice
    computed just before it is put (while it is in cache); ``written(offset, nbytes)`` after each piece.

    Returns each piece's CRC-32."""
    crcs = []
    for offset, view in work:
        crc = 0
        for pos in range(0, view.nbytes, CRC_SLICE_BYTES):
            part = view[pos:pos + CRC_SLICE_BYTES]
            crc = crc32(part, crc)
            put(part, offset + pos)
        crcs.append(crc)
        if written is not None:
            written(offset, view.nbytes)
    return crcs


def plan_tasks(pieces: list[Piece], chunk_bytes: int) -> list[list[tuple[Piece, int, int]]]:
    """Group ``pieces`` into tasks of about ``chunk_bytes``: lists of ``(piece, start, stop)`` ranges."""
    tasks: list[list[tuple[Piece, int, int]]] = []
    current: list[tuple[Piece, int, int]] = []
    filled = 0
    for p in pieces:
        start = 0
        while start < p.length:
            stop = min(p.length, start + chunk_bytes - filled)
            current.append((p, start, stop))
            filled += stop - start
            start = stop
            if filled >= chunk_bytes:
                tasks.append(current)
                current, filled = [], 0
    if current:
        tasks.append(current)
    return tasks


__all__ = ["CRC_SLICE_BYTES", "DEFAULT_CHUNK_BYTES", "in_io_pool", "io_executor", "io_threads", "plan_tasks", "put_task",
           "run_tasks"]
