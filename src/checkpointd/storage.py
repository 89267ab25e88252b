"""Store: the few storage primitives the pipeline needs, over any fsspec filesystem.

Why a layer of our own: fsspec's conveniences hide failures that matter here. ``exists()`` returns
False on a transient error, which in ``latest_step()`` would restart a run from scratch, and
``put``/``mv`` are not atomic on object stores. The Store exposes only what the commit protocol needs
(write a whole object durably, read, list step directories, delete) and raises builtins, never
mistaking a transient error for "not found".

What it adds over plain fsspec:

- **Retries.** Whole-object operations (``write_bytes``, ``read_bytes``, ``exists``, ``size``,
  ``list_dir``, ``is_file``, ``remove_tree``, ``remove``) are retried on transient errors under
  ``Store.retry`` (see :mod:`checkpointd.retry`). A streamed ``open_write`` cannot be replayed by the
  Store, so its caller retries the whole file with ``store.retry.call(...)``.
- **No partial object looks complete.** ``open_write`` files commit on ``close()`` only; leaving the
  ``with`` block by an exception calls ``abort()`` instead (fsspec files commit in that case). On S3 a
  multipart upload only appears when completed and is aborted on failure; on local disk ``close()``
  fsyncs the file and its directory, and ``abort()`` unlinks the partial file.
- **Parallel S3 multipart uploads.** s3fs's file writer uploads parts one after another as its buffer
  fills; :class:`_S3MultipartWriter` keeps up to ``max_parts_in_flight`` parts uploading at once on
  s3fs's event loop while the caller keeps writing, with memory bounded by
  ``part_size_bytes * (max_parts_in_flight + 1)``.
- **Fresh listings.** Listings and ``info`` on object stores bypass fsspec's listing cache, which can
  be stale when another process (or rank) wrote a marker.

Limits: a crash (SIGKILL) in the middle of a local write leaves a partial file; the commit marker
protocol (SPEC §2) is what makes that harmless, not this module.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import logging
import os
from collections.abc import Callable
from typing import IO, Any, Protocol, TypeVar

from fsspec import AbstractFileSystem
from fsspec.registry import register_implementation
from fsspec.core import url_to_fs

from . import layout
from .retry import RetryPolicy

__all__ = [
    "DEFAULT_MAX_PARTS_IN_FLIGHT",
    "DEFAULT_PART_SIZE_BYTES",
    "Store",
    "WriteFile",
]

logger = logging.getLogger("checkpointd")

T = TypeVar("T")

DEFAULT_PART_SIZE_BYTES = 8 * 2**20
"""S3 multipart part size; objects smaller than one part go up in a single PUT."""
DEFAULT_MAX_PARTS_IN_FLIGHT = 8
"""S3 parts uploading at once per file."""
_S3_MIN_PART_BYTES = 5 * 2**20  # S3's minimum for every part but the last
_S3_PARTS_PER_DOUBLING = 1000  # part size doubles every 1000 parts, staying under S3's 10,000 parts

# ``faulty://`` (fault injection for tests and harnesses) works in any root URL; fsspec imports the
# class only when such a URL is used.
with contextlib.suppress(ValueError):
    register_implementation("faulty", "checkpointd.testing.faults.FaultyFileSystem")


class WriteFile(Protocol):
    """What ``Store.open_write`` returns: a binary sink that commits on ``close()`` only."""

    def write(self, data: Any) -> int: ...
    def tell(self) -> int: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...
    def abort(self) -> None: ...
    def discard(self) -> None: ...
    def __enter__(self) -> WriteFile: ...
    def __exit__(self, *exc: object) -> None: ...


class Store:
    """One checkpoint root on one fsspec filesystem.

    Args:
        root: local path or fsspec URL; with ``fs``, a path on that filesystem.
        storage_options: passed to fsspec when building the filesystem.
        retry: backoff for transient errors of whole-object operations (default: ``RetryPolicy()``,
            two minutes).
        fs: an existing filesystem to use instead of building one from ``root``'s protocol.
        part_size_bytes: S3 multipart part size (at least 5 MiB).
        max_parts_in_flight: S3 parts of one file uploading at once.

    Paths given to methods are relative to the root and use '/'.
    Thread-safe as far as the underlying fsspec filesystem is (local, memory and s3fs are); one
    ``open_write`` file belongs to one thread.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        storage_options: dict[str, Any] | None = None,
        *,
        retry: RetryPolicy | None = None,
        fs: AbstractFileSystem | None = None,
        part_size_bytes: int = DEFAULT_PART_SIZE_BYTES,
        max_parts_in_flight: int = DEFAULT_MAX_PARTS_IN_FLIGHT,
    ) -> None:
        if part_size_bytes < _S3_MIN_PART_BYTES:
            raise ValueError(f"part_size_bytes must be >= {_S3_MIN_PART_BYTES} (S3's minimum), got {part_size_bytes}")
        if max_parts_in_flight < 1:
            raise ValueError(f"max_parts_in_flight must be >= 1, got {max_parts_in_flight}")
        root_str = os.fspath(root)
        if fs is None:
            self.fs, path = url_to_fs(root_str, **(storage_options or {}))
        else:
            self.fs, path = fs, fs._strip_protocol(root_str)
        self.root = path.rstrip("/") or "/"
        self.url = root_str
        self.is_local = _is_local(self.fs)
        self.retry = retry if retry is not None else RetryPolicy()
        self.part_size_bytes = part_size_bytes
        self.max_parts_in_flight = max_parts_in_flight
        self._root_checked = False

    def __repr__(self) -> str:
        return f"Store({self.url!r}, fs={type(self.fs).__name__})"

    def path(self, rel: str) -> str:
        return layout.join(self.root, rel) if rel else self.root

    def display(self, rel: str = "") -> str:
        """A path as the user should see it in messages (with the URL scheme)."""
        return layout.join(self.url, rel) if rel else self.url

    # -- writing -------------------------------------------------------------------------------
    def open_write(self, rel: str) -> WriteFile:
        """A binary file for writing; ``close()`` makes it durable, ``abort()`` (alias ``discard()``)
        throws it away: never call ``close()`` after a failed write, that would commit a partial object.

        Leaving a ``with`` block by an exception aborts: the object never appears (S3) or is removed
        (local disk, other filesystems). Not retried here: the caller retries the whole file, e.g.
        ``store.retry.call(write_it, describe=...)``.

        Raises:
            NotADirectoryError: the root is a file.
        """
        self._check_root_is_dir()
        return _open_writer(self.fs, self.path(rel), self)

    def write_bytes(self, rel: str, data: bytes | bytearray | memoryview) -> None:
        """Write a whole object durably, retried as a whole on transient errors."""
        self._check_root_is_dir()
        self._retried(self._write_bytes_once, rel, data, describe=f"write {self.display(rel)}")

    def _write_bytes_once(self, rel: str, data: bytes | bytearray | memoryview) -> None:
        with _open_writer(self.fs, self.path(rel), self) as f:
            f.write(data)

    def makedirs(self, rel: str) -> None:
        """Create a directory (local disk only; object stores have no directories)."""
        if self.is_local:
            self._check_root_is_dir()
            _local_makedirs(self.path(rel), self)

    # -- reading -------------------------------------------------------------------------------
    def open_read(self, rel: str) -> IO[bytes]:
        """A binary file for reading; opening is retried, reads are not."""
        full = self.path(rel)
        return self._retried(self.fs.open, full, "rb", describe=f"open {self.display(rel)}")

    def read_bytes(self, rel: str) -> bytes:
        """A whole object (ranged reads in parallel on s3fs), retried on transient errors."""
        full = self.path(rel)
        return bytes(self._retried(self._cat_file, full, describe=f"read {self.display(rel)}"))

    def _cat_file(self, full: str) -> bytes:
        if self.is_local:
            with open(full, "rb") as f:
                return f.read()
        return self.fs.cat_file(full)

    def exists(self, rel: str) -> bool:
        """True/False from a definite answer; transient errors are retried, then raised, never False."""
        return self._retried(self._exists_once, rel, describe=f"check {self.display(rel)}")

    def _exists_once(self, rel: str) -> bool:
        try:
            self._info(self.path(rel))
            return True
        except (FileNotFoundError, NotADirectoryError):
            return False

    def size(self, rel: str) -> int:
        return self._retried(lambda: int(self._info(self.path(rel))["size"]), describe=f"size {self.display(rel)}")

    def list_dir(self, rel: str = "") -> list[str]:
        """Base names of the entries directly under ``rel`` ([] when it does not exist).

        Always a fresh listing (no fsspec listing cache).

        Raises:
            NotADirectoryError: ``rel`` (or the root) is a file.
        """
        return self._retried(self._list_dir_once, rel, describe=f"list {self.display(rel)}")

    def _list_dir_once(self, rel: str) -> list[str]:
        full = self.path(rel)
        try:
            entries = self.fs.ls(full, detail=True, refresh=True)
        except FileNotFoundError:
            return []
        except NotADirectoryError as exc:
            raise self._not_a_dir(rel) from exc
        names = set()
        for entry in entries:
            name = entry["name"].rstrip("/")
            if entry.get("type") == "file" and self.fs._strip_protocol(name).rstrip("/") == full.rstrip("/"):
                raise self._not_a_dir(rel)  # fsspec lists a file as itself
            names.add(name.rsplit("/", 1)[-1])
        return sorted(names)

    def is_file(self, rel: str = "") -> bool:
        return self._retried(self._is_file_once, rel, describe=f"check {self.display(rel)}")

    def _is_file_once(self, rel: str) -> bool:
        try:
            return self._info(self.path(rel))["type"] == "file"
        except (FileNotFoundError, NotADirectoryError):
            return False

    def _info(self, full: str) -> dict[str, Any]:
        if not self.is_local:
            self.fs.invalidate_cache(full)  # s3fs answers info() from a possibly stale listing cache
        return self.fs.info(full)

    # -- deleting ------------------------------------------------------------------------------
    def remove_tree(self, rel: str) -> None:
        """Delete ``rel`` and everything under it; a missing path is not an error."""
        self._retried(self._remove_tree_once, rel, describe=f"remove {self.display(rel)}")

    def _remove_tree_once(self, rel: str) -> None:
        full = self.path(rel)
        if not self.is_local:
            self.fs.invalidate_cache(full)
        if _is_s3(self.fs):
            _s3_remove_tree(self.fs, full)
            return
        try:
            self.fs.rm(full, recursive=True)
        except FileNotFoundError:
            pass

    def remove(self, rel: str) -> None:
        """Delete one file; a missing file is not an error."""
        self._retried(self._remove_once, rel, describe=f"remove {self.display(rel)}")

    def _remove_once(self, rel: str) -> None:
        try:
            self.fs.rm_file(self.path(rel))
        except FileNotFoundError:
            pass

    # -- helpers -------------------------------------------------------------------------------
    def _retried(self, fn: Callable[..., T], *args: Any, describe: str) -> T:
        return self.retry.call(fn, *args, describe=describe)

    def _not_a_dir(self, rel: str) -> NotADirectoryError:
        where = self.display(rel)
        if not rel:
            return NotADirectoryError(
                errno.ENOTDIR,
                f"checkpoint root {where} is a file, not a directory; pass a directory (it is created "
                "if missing), or pass the file itself to checkpointd.load()",
            )
        return NotADirectoryError(errno.ENOTDIR, f"{where} is a file, not a directory")

    def _check_root_is_dir(self) -> None:
        """Raise NotADirectoryError once if the root is an existing file (checked on first write)."""
        if self._root_checked:
            return
        if self._retried(self._is_file_once, "", describe=f"check {self.display()}"):
            raise self._not_a_dir("")
        self._root_checked = True


def _is_local(fs: AbstractFileSystem) -> bool:
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return "file" in protocols or "local" in protocols


def _is_s3(fs: AbstractFileSystem) -> bool:
    return hasattr(fs, "_call_s3") and hasattr(fs, "split_path") and hasattr(fs, "loop")


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


def _open_writer(fs: AbstractFileSystem, full: str, store: Store) -> WriteFile:
    """The best writer for ``fs``; a wrapper filesystem may wrap the writer of its target."""
    wrap = getattr(fs, "wrap_write_file", None)
    target = getattr(fs, "target", None)
    if callable(wrap) and isinstance(target, AbstractFileSystem):
        inner = target._strip_protocol(full)
        return wrap(full, lambda: _open_writer(target, inner, store))  # testing.faults.FaultyFileSystem
    if _is_local(fs):
        _local_makedirs(os.path.dirname(full), store)
        return _DurableLocalFile(full)
    if _is_s3(fs):
        return _S3MultipartWriter(fs, full, store.part_size_bytes, store.max_parts_in_flight, store.retry)
    return _GuardedFile(fs, full)


def _local_makedirs(path: str, store: Store) -> None:
    try:
        os.makedirs(path, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as exc:
        if os.path.isfile(store.root):
            raise store._not_a_dir("") from exc
        raise NotADirectoryError(errno.ENOTDIR, f"cannot create directory {path}: a file is in the way") from exc


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
    """A local file whose ``close()`` fsyncs the data and its directory entry."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._f = open(path, "wb", buffering=0)
        self._pos = 0

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
            os.fsync(self._f.fileno())
        except BaseException:
            self.abort()
            raise
        self._f.close()
        dir_fd = os.open(os.path.dirname(self._path) or ".", os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def abort(self) -> None:
        """Close without syncing and unlink the partial file (best effort)."""
        with contextlib.suppress(OSError):
            self._f.close()
        with contextlib.suppress(OSError):
            os.unlink(self._path)


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
