"""The writers behind ``Store.open_write``: one per kind of backend, all with ``close`` (commit) and ``abort``.

Why not fsspec's own file objects: closing one commits whatever was written, also when the ``with``
block is left by an exception, and a partial object must never look complete. These writers commit
only on ``close()`` and throw the partial data away on ``abort()``:

- ``_DurableLocalFile``: a local file; ``close`` fsyncs it and its directory, ``abort`` unlinks it.
- ``_S3MultipartWriter``: parallel multipart upload on s3fs's event loop; the object appears only when
  the upload completes, ``abort`` aborts the multipart upload.
- ``_GuardedFile``: any other fsspec file; ``abort`` discards or deletes it.

Local paths below a checkpoint root are opened one component at a time from the root, never
following a link (:func:`checkpointd.storage.localpaths.open_dir_below`): the root is shared, and whatever links others plant in it,
nothing the library deletes, truncates or writes over lies outside it. A file is never written through
an existing name: whatever is there (the checkpoint's own leftover, or something planted) is unlinked
and a new file created with ``O_EXCL|O_NOFOLLOW`` (:func:`checkpointd.storage.localpaths.create_file`), or a retired file taken from
the recycling bin is checked on its open descriptor (a regular file with one link) before a byte goes in.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
from typing import Any

from fsspec import AbstractFileSystem

from checkpointd.storage import recycle
from checkpointd.storage.localpaths import create_file, open_parent_below
from checkpointd.storage.retry import RetryPolicy

logger = logging.getLogger("checkpointd")

_S3_PARTS_PER_DOUBLING = 1000  # part size doubles every 1000 parts, staying under S3's 10,000 parts


def _s3_remove_tree(fs: Any, full: str) -> None:
    """Delete every object under ``full``, then the "directory" keys ``.../`` above them.

    Deleting the directory keys matters on S3 servers with real directories (SeaweedFS keeps an
    emptied prefix listed until ``prefix/`` itself is deleted); on AWS they are no-ops.
    """
    files = fs.find(full)
    if files:
        fs.rm(files)
    bucket, root_key, _ = fs.split_path(full)
    dirs = {root_key.rstrip("/")}
    for path in files:
        key = fs.split_path(path)[1]
        while "/" in key and len(key) > len(root_key):
            key = key.rsplit("/", 1)[0]
            dirs.add(key)
    keys = sorted((d + "/" for d in dirs if d), key=len, reverse=True)  # deepest first
    for i in range(0, len(keys), 1000):
        fs.call_s3("delete_objects", Bucket=bucket,
                   Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]], "Quiet": True})
    fs.invalidate_cache(full)


class _WriterBase:
    """Context-manager behaviour shared by the writers: commit on success, abort on exception."""

    def __enter__(self) -> Any:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def flush(self) -> None:
        """No-op: data becomes durable on ``close()`` only."""

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False

    def seekable(self) -> bool:
        return False

    def close(self) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError

    def discard(self) -> None:
        """fsspec's name for :meth:`abort`."""
        self.abort()


class _DurableLocalFile(_WriterBase):
    """A local file whose ``close()`` fsyncs the data and its directory entry.

    ``dir_fd`` (owned from then on) is the directory, opened without following links
    (:func:`checkpointd.storage.localpaths.open_dir_below`); ``name`` the file's name in it; ``where`` its path for messages. The file is
    new (:func:`checkpointd.storage.localpaths.create_file`), or, with ``recycle_from`` (a recycling bin, :mod:`checkpointd.storage.recycle`), a
    retired file about ``expected_bytes`` large taken from it, checked on its descriptor, written over
    from its start and cut to the bytes written at ``close()``.
    """

    def __init__(self, dir_fd: int, name: str, where: str, recycle_from: str | None = None,
                 expected_bytes: int = 0) -> None:
        self._dir_fd = dir_fd
        self._name = name
        self._path = where
        try:
            fd = recycle.take_open(recycle_from, dir_fd, name, expected_bytes) if recycle_from is not None else None
            self._recycled = fd is not None
            if fd is None:
                fd = create_file(dir_fd, name, where)
            self._f = open(fd, "r+b" if self._recycled else "wb", buffering=0)
        except BaseException:
            self._close_dir()
            raise
        self._pos = 0

    @classmethod
    def below(cls, root: str, rel: str, recycle_from: str | None = None, expected_bytes: int = 0) -> "_DurableLocalFile":
        """The file ``rel`` below ``root``; missing directories are made, links below the root refused."""
        dir_fd, name = open_parent_below(root, rel, create=True)
        return cls(dir_fd, name, os.path.join(root, rel), recycle_from, expected_bytes)

    @property
    def recycled(self) -> bool:
        """Written over a file taken from the recycling bin (``stats()["last_save"]["files_recycled"]``)."""
        return self._recycled

    @property
    def closed(self) -> bool:
        return self._f.closed

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        total = 0
        while total < view.nbytes:
            total += self._f.write(view[total:])
        self._pos += total
        return total

    def tell(self) -> int:
        return self._pos

    def close(self) -> None:
        if self._f.closed:
            return
        try:
            if self._recycled:
                os.ftruncate(self._f.fileno(), self._pos)
            os.fsync(self._f.fileno())
        except BaseException:
            self.abort()
            raise
        self._f.close()
        try:
            os.fsync(self._dir_fd)
        finally:
            self._close_dir()

    def abort(self) -> None:
        """Close without syncing and unlink the partial file (best effort)."""
        with contextlib.suppress(OSError):
            self._f.close()
        if self._dir_fd >= 0:
            with contextlib.suppress(OSError):
                os.unlink(self._name, dir_fd=self._dir_fd)
        self._close_dir()

    def _close_dir(self) -> None:
        if self._dir_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._dir_fd)
            self._dir_fd = -1

    def __del__(self) -> None:
        self._close_dir()


class _GuardedFile(_WriterBase):
    """An fsspec file that commits on ``close()`` only; ``abort()`` discards or deletes the object."""

    def __init__(self, fs: AbstractFileSystem, path: str) -> None:
        self._fs = fs
        self._path = path
        self._f = fs.open(path, "wb")
        self._pos = 0
        self.closed = False

    def write(self, data: Any) -> int:
        n = self._f.write(data)
        self._pos += memoryview(data).nbytes
        return n if isinstance(n, int) else memoryview(data).nbytes

    def tell(self) -> int:
        return self._pos

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self._f.close()
        except BaseException:
            self._discard()
            raise

    def abort(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._discard()

    def _discard(self) -> None:
        from fsspec.spec import AbstractBufferedFile

        buffered = isinstance(self._f, AbstractBufferedFile)
        discard = getattr(type(self._f), "discard", None)
        if buffered and discard is not None and discard is not AbstractBufferedFile.discard:
            try:
                self._f.discard()  # the backend aborts its upload (gcsfs, s3fs)
                self._f.closed = True  # keep fsspec's __del__ from committing what is left
                return
            except Exception:  # noqa: BLE001 - fall back to deleting
                pass
        if buffered:
            self._f.closed = True  # never commit the partial buffer
        else:
            with contextlib.suppress(Exception):
                self._f.close()  # local and memory files: already visible, nothing more to publish
        with contextlib.suppress(Exception):
            self._fs.rm_file(self._path)


class _S3MultipartWriter(_WriterBase):
    """Streams an S3 object as a multipart upload with several parts in flight.

    ``write()`` copies the data (callers reuse their buffers) into parts of ``part_size`` bytes and
    hands each to s3fs's event loop; it blocks only while ``max_in_flight`` parts are already
    uploading. Each part is retried on its own under ``retry``. ``close()`` uploads the tail, waits
    for all parts and completes the upload, the only moment the object becomes visible; objects
    smaller than one part go up in a single PUT at close. Any failure aborts the multipart upload.
    """

    def __init__(self, fs: Any, path: str, part_size: int, max_in_flight: int, retry: RetryPolicy) -> None:
        self._fs = fs
        self._path = path
        self._bucket, self._key, _ = fs.split_path(path)
        self._part_size = part_size
        self._max_in_flight = max_in_flight
        self._retry = retry
        self._buf = bytearray()
        self._pos = 0
        self._upload_id: str | None = None
        self._next_part = 1
        self._pending: list[concurrent.futures.Future[dict[str, Any]]] = []
        self._done: list[dict[str, Any]] = []
        self.closed = False

    def write(self, data: Any) -> int:
        if self.closed:
            raise ValueError(f"write to closed file {self._path}")
        view = memoryview(data).cast("B")
        n = view.nbytes
        offset = 0
        try:
            if self._buf:
                take = min(n, self._current_part_size() - len(self._buf))
                self._buf += view[:take]
                offset = take
                if len(self._buf) >= self._current_part_size():
                    self._submit(bytes(self._buf))
                    self._buf = bytearray()
            while n - offset >= self._current_part_size():
                size = self._current_part_size()
                self._submit(bytes(view[offset:offset + size]))  # one copy, straight from the caller
                offset += size
            self._buf += view[offset:]
        except BaseException:
            self.abort()
            raise
        self._pos += n
        return n

    def tell(self) -> int:
        return self._pos

    def close(self) -> None:
        if self.closed:
            return
        try:
            if self._upload_id is None:
                self._call("put_object", Body=bytes(self._buf))
            else:
                if self._buf:
                    self._submit(bytes(self._buf))
                self._buf = bytearray()
                self._wait(0)
                parts = sorted(({"PartNumber": p["PartNumber"], "ETag": p["ETag"]} for p in self._done),
                               key=lambda p: p["PartNumber"])
                self._call("complete_multipart_upload", UploadId=self._upload_id,
                           MultipartUpload={"Parts": parts})
        except BaseException:
            self.abort()
            raise
        self.closed = True
        self._buf = bytearray()
        self._fs.invalidate_cache(self._path)

    def abort(self) -> None:
        """Cancel parts in flight and abort the multipart upload (best effort); nothing appears."""
        if self.closed:
            return
        self.closed = True
        self._buf = bytearray()
        for fut in self._pending:
            fut.cancel()
        concurrent.futures.wait(self._pending, timeout=30)
        self._pending = []
        if self._upload_id is not None:
            try:
                self._fs.call_s3("abort_multipart_upload", Bucket=self._bucket, Key=self._key,
                                 UploadId=self._upload_id)
            except Exception as exc:  # noqa: BLE001 - the upload stays invisible; lifecycle rules reap it
                logger.warning("could not abort multipart upload of %s: %r", self._path, exc)
            self._upload_id = None

    # -- internals ---------------------------------------------------------------------------
    def _current_part_size(self) -> int:
        return self._part_size * 2 ** ((self._next_part - 1) // _S3_PARTS_PER_DOUBLING)

    def _call(self, method: str, **kwargs: Any) -> dict[str, Any]:
        return self._retry.call(self._fs.call_s3, method, Bucket=self._bucket, Key=self._key,
                                describe=f"{method} s3://{self._path}", **kwargs)

    def _submit(self, body: bytes) -> None:
        if self._upload_id is None:
            self._upload_id = self._call("create_multipart_upload")["UploadId"]
        self._wait(self._max_in_flight - 1)
        part = self._next_part
        self._next_part += 1
        coro = self._upload_part(part, body)
        self._pending.append(asyncio.run_coroutine_threadsafe(coro, self._fs.loop))

    def _wait(self, max_pending: int) -> None:
        """Block until at most ``max_pending`` parts are in flight; raise the first part failure."""
        while self._pending:
            done = [f for f in self._pending if f.done()]
            if not done and len(self._pending) <= max_pending:
                return
            if not done:
                concurrent.futures.wait(self._pending, return_when=concurrent.futures.FIRST_COMPLETED)
                continue
            for fut in done:
                self._pending.remove(fut)
                self._done.append(fut.result())  # raises the part's error

    async def _upload_part(self, part: int, body: bytes) -> dict[str, Any]:
        out = await self._retry.call_async(
            self._fs._call_s3, "upload_part", Bucket=self._bucket, Key=self._key, UploadId=self._upload_id,
            PartNumber=part, Body=body, describe=f"upload part {part} of s3://{self._path}",
        )
        return {"PartNumber": part, "ETag": out["ETag"]}
