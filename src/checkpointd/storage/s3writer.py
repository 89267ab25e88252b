"""Parallel S3 multipart uploads behind ``Store.open_write``, and deleting a tree of S3 objects.

s3fs's file writer uploads parts one after another as its buffer fills; :class:`S3MultipartWriter` keeps
up to ``max_parts_in_flight`` parts uploading at once on s3fs's event loop while the caller keeps
writing, with memory bounded by ``part_size_bytes * (max_parts_in_flight + 1)``. The object appears
only when the upload completes; ``abort`` aborts the multipart upload.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from typing import Any

from fsspec import AbstractFileSystem

from checkpointd.storage.retry import RetryPolicy
from checkpointd.storage.writerbase import WriterBase

logger = logging.getLogger("checkpointd")

S3_PARTS_PER_DOUBLING = 1000
"""A part's size doubles every this many parts, staying under S3's 10,000 parts."""


def s3_remove_tree(fs: Any, full: str) -> None:
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



def is_s3(fs: AbstractFileSystem) -> bool:
    """Whether ``fs`` is s3fs's (or looks like it: the calls the multipart writer makes)."""
    return hasattr(fs, "_call_s3") and hasattr(fs, "split_path") and hasattr(fs, "loop")


class S3MultipartWriter(WriterBase):
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
        return self._part_size * 2 ** ((self._next_part - 1) // S3_PARTS_PER_DOUBLING)

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


__all__ = ["S3MultipartWriter", "S3_PARTS_PER_DOUBLING", "is_s3", "s3_remove_tree"]
