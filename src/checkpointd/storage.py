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

import contextlib
import errno
import logging
import os
from collections.abc import Callable
from types import TracebackType
from typing import IO, Any, Protocol, TypeVar

from fsspec import AbstractFileSystem
from fsspec.registry import register_implementation
from fsspec.core import url_to_fs

from . import layout
from . import recycle as recycling
from .retry import RetryPolicy
from .storage_writers import _DurableLocalFile, _GuardedFile, _S3MultipartWriter, _s3_remove_tree

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
    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None, /
    ) -> None: ...


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
    def open_write(self, rel: str, expected_bytes: int = 0) -> WriteFile:
        """A binary file for writing; ``close()`` makes it durable, ``abort()`` (alias ``discard()``)
        throws it away: never call ``close()`` after a failed write, that would commit a partial object.

        Leaving a ``with`` block by an exception aborts: the object never appears (S3) or is removed
        (local disk, other filesystems). Not retried here: the caller retries the whole file, e.g.
        ``store.retry.call(write_it, describe=...)``.

        ``expected_bytes``: about how large the file will be; on a local store a large file may be
        written over a retired one (:mod:`checkpointd.recycle`).

        Raises:
            NotADirectoryError: the root is a file.
        """
        self._check_root_is_dir()
        return _open_writer(self.fs, self.path(rel), self, expected_bytes)

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


def _open_writer(fs: AbstractFileSystem, full: str, store: Store, expected_bytes: int = 0) -> WriteFile:
    """The best writer for ``fs``; a wrapper filesystem may wrap the writer of its target.

    ``expected_bytes``: see :meth:`Store.open_write`.
    """
    wrap = getattr(fs, "wrap_write_file", None)
    target = getattr(fs, "target", None)
    if callable(wrap) and isinstance(target, AbstractFileSystem):
        inner = target._strip_protocol(full)
        return wrap(full, lambda: _open_writer(target, inner, store))  # testing.faults.FaultyFileSystem
    if _is_local(fs):
        _local_makedirs(os.path.dirname(full), store)
        return _DurableLocalFile(full, recycle_from=recycling.bin_for(store) if expected_bytes else None,
                                 expected_bytes=expected_bytes)
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
