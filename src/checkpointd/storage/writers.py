"""The writers behind ``Store.open_write``: one per kind of backend, all with ``close`` (commit) and ``abort``.

Why not fsspec's own file objects: closing one commits whatever was written, also when the ``with``
block is left by an exception, and a partial object must never look complete. These writers commit
only on ``close()`` and throw the partial data away on ``abort()``:

- :class:`DurableLocalFile`: a local file; ``close`` fsyncs it and its directory, ``abort`` unlinks it.
- :class:`checkpointd.storage.s3writer.S3MultipartWriter`: parallel multipart upload on s3fs's event
  loop; the object appears only when the upload completes, ``abort`` aborts the multipart upload.
- :class:`GuardedFile`: any other fsspec file; ``abort`` discards or deletes it.

:func:`open_writer` picks the writer for a filesystem.

Local paths below a checkpoint root are opened one component at a time from the root, never
following a link (:func:`checkpointd.storage.localpaths.open_dir_below`): the root is shared, and whatever links others plant in it,
nothing the library deletes, truncates or writes over lies outside it. A file is never written through
an existing name: whatever is there (the checkpoint's own leftover, or something planted) is unlinked
and a new file created with ``O_EXCL|O_NOFOLLOW`` (:func:`checkpointd.storage.localpaths.create_file`), or a retired file taken from
the recycling bin is checked on its open descriptor (a regular file with one link) ahead of the first byte.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from typing import Any

from fsspec import AbstractFileSystem

from checkpointd.storage import localpaths
from checkpointd.storage import recyclebin
from checkpointd.storage.localpaths import create_file, open_parent_below
from checkpointd.storage.s3writer import S3MultipartWriter, is_s3
from checkpointd.storage.writerbase import WriteFile, WriterBase

logger = logging.getLogger("checkpointd")


class DurableLocalFile(WriterBase):
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
            fd = recyclebin.take_open(recycle_from, dir_fd, name, expected_bytes) if recycle_from is not None else None
            self._recycled = fd is not None
            if fd is None:
                fd = create_file(dir_fd, name, where)
            self._f = open(fd, "r+b" if self._recycled else "wb", buffering=0)
        except BaseException:
            self._close_dir()
            raise
        self._pos = 0

    @classmethod
    def below(cls, root: str, rel: str, recycle_from: str | None = None, expected_bytes: int = 0) -> "DurableLocalFile":
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


class GuardedFile(WriterBase):
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


def is_local(fs: AbstractFileSystem) -> bool:
    """Whether ``fs`` is the local filesystem."""
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return "file" in protocols or "local" in protocols


def open_writer(fs: AbstractFileSystem, full: str, store: Any, expected_bytes: int = 0) -> WriteFile:
    """The best writer for ``fs``; a wrapper filesystem may wrap the writer of its target.

    ``store``: the :class:`checkpointd.storage.store.Store` writing; ``expected_bytes``: see
    :meth:`checkpointd.storage.store.Store.open_write`.
    """
    wrap = getattr(fs, "wrap_write_file", None)
    target = getattr(fs, "target", None)
    if callable(wrap) and isinstance(target, AbstractFileSystem):
        inner = target._strip_protocol(full)
        return wrap(full, lambda: open_writer(target, inner, store))  # testing.faults.FaultyFileSystem
    if is_local(fs):
        root = store.root.rstrip("/")
        parts = localpaths.rel_parts(full[len(root) + 1:]) if full.startswith(root + "/") else []
        if not parts:  # not below the root (a wrapped filesystem's own path): below its own directory
            root, parts = os.path.dirname(full) or ".", [os.path.basename(full)]
        recycle_from = recyclebin.bin_for(store) if expected_bytes else None
        dir_fd = local_makedirs(root or "/", parts[:-1], store)
        return DurableLocalFile(dir_fd, parts[-1], full, recycle_from=recycle_from, expected_bytes=expected_bytes)
    if is_s3(fs):
        return S3MultipartWriter(fs, full, store.part_size_bytes, store.max_parts_in_flight, store.retry)
    return GuardedFile(fs, full)


def local_makedirs(root: str, parts: list[str], store: Any) -> int:
    """The directory ``root/parts...`` (made where missing), opened without following links below the
    root; the caller closes the descriptor."""
    try:
        return localpaths.open_dir_below(root, parts, create=True)
    except (FileExistsError, NotADirectoryError) as exc:
        if os.path.isfile(store.root):
            raise store.not_a_directory("") from exc
        if isinstance(exc, NotADirectoryError) and exc.strerror:
            raise NotADirectoryError(errno.ENOTDIR, f"cannot create directory {os.path.join(root, *parts)}: {exc.strerror}") from exc
        raise NotADirectoryError(errno.ENOTDIR, f"cannot create directory {os.path.join(root, *parts)}: a file is in the way") from exc


__all__ = ["DurableLocalFile", "GuardedFile", "is_local", "local_makedirs", "open_writer"]
