"""Store: the few storage primitives the pipeline needs, over any fsspec filesystem.

Why a layer of our own: fsspec's conveniences hide failures that matter here. ``exists()`` returns
False on a transient error, which in ``latest_step()`` would restart a run from scratch, and
``put``/``mv`` are not atomic on object stores. The Store exposes only what the commit protocol needs
(write a whole object durably, read, list step directories, delete) and raises builtins, never
mistaking a transient error for "not found".

What it adds over plain fsspec:

- **Retries.** Whole-object operations (``write_bytes``, ``read_bytes``, ``exists``, ``size``,
  ``list_dir``, ``is_file``, ``remove_tree``, ``remove``) are retried on transient errors under
  ``Store.retry`` (see :mod:`checkpointd.storage.retry`). A streamed ``open_write`` cannot be replayed by the
  Store, so its caller retries the whole file with ``store.retry.call(...)``.
- **No partial object looks complete.** ``open_write`` files commit on ``close()`` only; leaving the
  ``with`` block by an exception calls ``abort()`` instead (fsspec files commit in that case). On S3 a
  multipart upload only appears when completed and is aborted on failure; on local disk ``close()``
  fsyncs the file and its directory, and ``abort()`` unlinks the partial file.
- **Parallel S3 multipart uploads.** s3fs's file writer uploads parts one after another as its buffer
  fills; :class:`checkpointd.storage.s3writer.S3MultipartWriter` keeps up to ``max_parts_in_flight``
  parts uploading at once on s3fs's event loop while the caller keeps writing, with memory bounded by
  ``part_size_bytes * (max_parts_in_flight + 1)``.
- **Fresh listings.** Listings, ``info`` and opening for reading on object stores bypass fsspec's
  listing cache, which can be stale when another process (or rank) wrote a marker or rewrote a file.

- **Nothing outside the root** (local roots). The root is shared and untrusted: others may plant
  symbolic links, hard links and fifos in it. Whatever it holds, nothing the Store deletes, truncates
  or writes over lies outside the root. Paths are opened component by component from the root without
  following links (:func:`checkpointd.storage.localpaths.open_dir_below`); a path through a link below the
  root is refused with :class:`LinkedPathError` (a :class:`~checkpointd.errors.CheckpointError` and an
  ``OSError``), except removing the link itself (``remove``/``remove_tree`` of its own name unlink the
  link, never its target); files are written as new files (``O_EXCL|O_NOFOLLOW`` after unlinking
  whatever name was there), never through an existing name. Reads open with ``O_NONBLOCK|O_NOFOLLOW``
  and accept regular files only: a fifo, socket, device, directory or link where a file should be
  raises :class:`~checkpointd.errors.CorruptCheckpointError` naming it, never blocks. ``exists``,
  ``size``, ``is_file`` and ``list_dir`` see a link as an entry of its own (not a file) and nothing
  behind it. The root itself is the caller's path: links in it are followed. Object stores have no
  links; their paths are unchanged.

Limits: a crash (SIGKILL) in the middle of a local write leaves a partial file; the commit marker
protocol (SPEC §2) is what makes that harmless, not this module.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
from collections.abc import Callable
from typing import IO, Any, TypeVar

from fsspec import AbstractFileSystem
from fsspec.core import url_to_fs
from fsspec.registry import register_implementation

from checkpointd.errors import CorruptCheckpointError, LinkedPathError
from checkpointd.format import layout
from checkpointd.storage import localpaths as local
from checkpointd.storage.retry import RetryPolicy
from checkpointd.storage.s3writer import s3_remove_tree
from checkpointd.storage.writerbase import WriteFile
from checkpointd.storage.writers import is_local, local_makedirs, open_writer
from checkpointd.storage.s3writer import is_s3

__all__ = ["DEFAULT_MAX_PARTS_IN_FLIGHT", "DEFAULT_PART_SIZE_BYTES", "Store"]

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
        self.is_local = is_local(self.fs)
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
        written over a retired one (:mod:`checkpointd.storage.recycle`).

        Raises:
            NotADirectoryError: the root is a file.
            LinkedPathError: a component of ``rel`` below the (local) root is a symbolic link.
        """
        self._check_root_is_dir()
        return open_writer(self.fs, self.path(rel), self, expected_bytes)

    def write_bytes(self, rel: str, data: bytes | bytearray | memoryview) -> None:
        """Write a whole object durably, retried as a whole on transient errors."""
        self._check_root_is_dir()
        self._retried(self._write_bytes_once, rel, data, describe=f"write {self.display(rel)}")

    def _write_bytes_once(self, rel: str, data: bytes | bytearray | memoryview) -> None:
        with open_writer(self.fs, self.path(rel), self) as f:
            f.write(data)

    def makedirs(self, rel: str) -> None:
        """Create a directory (local disk only; object stores have no directories).

        Raises:
            LinkedPathError: a component of ``rel`` below the root is a symbolic link.
            NotADirectoryError: a component is a file.
        """
        if self.is_local:
            self._check_root_is_dir()
            os.close(local_makedirs(self.root, local.rel_parts(rel), self))

    # -- reading -------------------------------------------------------------------------------
    def open_read(self, rel: str) -> IO[bytes]:
        """A binary file for reading; opening is retried, reads are not.

        Raises:
            CorruptCheckpointError: (local) ``rel`` is not a regular file (a fifo, directory, link...) or
                lies behind a link below the root.
        """
        if self.is_local:
            return self._retried(self._open_local_read, rel, describe=f"open {self.display(rel)}")
        full = self.path(rel)
        return self._retried(self._open_remote_read, full, describe=f"open {self.display(rel)}")

    def _open_remote_read(self, full: str) -> IO[bytes]:
        # s3fs opens with the size and ETag of its listing cache and refuses reads once the ETag changed:
        # a file another process rewrote since a listing must open as it is now
        self.fs.invalidate_cache(full)
        return self.fs.open(full, "rb")

    def read_bytes(self, rel: str) -> bytes:
        """A whole object (ranged reads in parallel on s3fs), retried on transient errors.

        Raises:
            CorruptCheckpointError: as :meth:`open_read`.
        """
        full = self.path(rel)
        return bytes(self._retried(self._cat_file, rel, full, describe=f"read {self.display(rel)}"))

    def _cat_file(self, rel: str, full: str) -> bytes:
        if self.is_local:
            with self._open_local_read(rel) as f:
                return f.read()
        return self.fs.cat_file(full)

    def _open_local_read(self, rel: str) -> IO[bytes]:
        """``rel`` opened for reading without following links below the root and without blocking on a
        fifo; anything but a regular file is refused (one ``fstat``)."""
        where = self.display(rel)
        flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            if not rel.strip("/"):
                fd = os.open(self.root, flags)  # the root itself: the caller's path
            else:
                dir_fd, name = local.open_parent_below(self.root, rel)
                try:
                    fd = os.open(name, flags | getattr(os, "O_NOFOLLOW", 0), dir_fd=dir_fd)
                except OSError as exc:
                    raise _unreadable(exc, where, dir_fd, name) from exc
                finally:
                    os.close(dir_fd)
        except LinkedPathError as exc:
            raise CorruptCheckpointError(f"{where} lies behind a link inside the root ({exc}); the checkpoint is damaged") from exc
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                raise CorruptCheckpointError(f"{where} is not a regular file ({local.kind_of(mode)}); the checkpoint is damaged")
            os.set_blocking(fd, True)
            return os.fdopen(fd, "rb")
        except BaseException:
            os.close(fd)
            raise

    def exists(self, rel: str) -> bool:
        """True/False from a definite answer; transient errors are retried, then raised, never False.

        On a local root a link is an entry (it exists) and nothing behind it does."""
        return self._retried(self._exists_once, rel, describe=f"check {self.display(rel)}")

    def _exists_once(self, rel: str) -> bool:
        try:
            if self.is_local:
                self._lstat(rel)
            else:
                self._info(self.path(rel))
            return True
        except (FileNotFoundError, NotADirectoryError):
            return False

    def size(self, rel: str) -> int:
        """Bytes of ``rel``; on a local root a link's own size (never followed), and nothing behind a link
        (FileNotFoundError)."""
        if self.is_local:
            return self._retried(lambda: int(self._lstat(rel).st_size), describe=f"size {self.display(rel)}")
        return self._retried(lambda: int(self._info(self.path(rel))["size"]), describe=f"size {self.display(rel)}")

    def is_link(self, rel: str) -> bool:
        """Whether ``rel`` is a symbolic link planted in a local root (always False on object stores, no
        request made). Such an entry is removed as itself (``remove_tree``), never descended into."""
        if not self.is_local or not rel.strip("/"):
            return False
        try:
            return stat.S_ISLNK(self._lstat(rel).st_mode)
        except (FileNotFoundError, NotADirectoryError):
            return False

    def _lstat(self, rel: str) -> os.stat_result:
        """``lstat`` of ``rel`` below the local root, its directories opened without following links; a
        path through a link is not in the root (FileNotFoundError)."""
        if not rel.strip("/"):
            return os.stat(self.root)
        try:
            dir_fd, name = local.open_parent_below(self.root, rel)
        except LinkedPathError as exc:
            raise FileNotFoundError(errno.ENOENT, f"{self.display(rel)} lies behind a link: not in the root") from exc
        try:
            return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        finally:
            os.close(dir_fd)

    def list_dir(self, rel: str = "") -> list[str]:
        """Base names of the entries directly under ``rel`` ([] when it does not exist).

        Always a fresh listing (no fsspec listing cache).

        Raises:
            NotADirectoryError: ``rel`` (or the root) is a file.
        """
        return self._retried(self._list_dir_once, rel, describe=f"list {self.display(rel)}")

    def _list_dir_once(self, rel: str) -> list[str]:
        if self.is_local:
            return self._list_local(rel)
        full = self.path(rel)
        try:
            entries = self.fs.ls(full, detail=True, refresh=True)
        except FileNotFoundError:
            return []
        except NotADirectoryError as exc:
            raise self.not_a_directory(rel) from exc
        names = set()
        for entry in entries:
            name = entry["name"].rstrip("/")
            if entry.get("type") == "file" and self.fs._strip_protocol(name).rstrip("/") == full.rstrip("/"):
                raise self.not_a_directory(rel)  # fsspec lists a file as itself
            names.add(name.rsplit("/", 1)[-1])
        return sorted(names)

    def _list_local(self, rel: str) -> list[str]:
        """A local listing through descriptors: a link below the root lists nothing."""
        try:
            fd = local.open_dir_below(self.root, local.rel_parts(rel))
        except FileNotFoundError:
            return []
        except LinkedPathError:
            return []
        except NotADirectoryError as exc:
            raise self.not_a_directory(rel) from exc
        try:
            return sorted(os.listdir(fd))
        finally:
            os.close(fd)

    def is_file(self, rel: str = "") -> bool:
        """Whether ``rel`` is a file; on a local root only a regular file is (a link below the root, a fifo
        or a device is not)."""
        return self._retried(self._is_file_once, rel, describe=f"check {self.display(rel)}")

    def _is_file_once(self, rel: str) -> bool:
        try:
            if self.is_local:
                return stat.S_ISREG(self._lstat(rel).st_mode)
            return self._info(self.path(rel))["type"] == "file"
        except (FileNotFoundError, NotADirectoryError):
            return False

    def _info(self, full: str) -> dict[str, Any]:
        if not self.is_local:
            self.fs.invalidate_cache(full)  # s3fs answers info() from a possibly stale listing cache
        return self.fs.info(full)

    # -- deleting ------------------------------------------------------------------------------
    def remove_tree(self, rel: str) -> None:
        """Delete ``rel`` and everything under it; a missing path is not an error.

        On a local root nothing is followed: a link (at ``rel`` or under it) is unlinked itself, never
        its target.

        Raises:
            LinkedPathError: a component of ``rel`` above its last one is a symbolic link.
        """
        self._retried(self._remove_tree_once, rel, describe=f"remove {self.display(rel)}")

    def _remove_tree_once(self, rel: str) -> None:
        full = self.path(rel)
        if self.is_local:
            self._remove_local(rel, tree=True)
            return
        if not self.is_local:
            self.fs.invalidate_cache(full)
        if is_s3(self.fs):
            s3_remove_tree(self.fs, full)
            return
        try:
            self.fs.rm(full, recursive=True)
        except FileNotFoundError:
            pass

    def remove(self, rel: str) -> None:
        """Delete one file; a missing file is not an error. On a local root a link is unlinked itself.

        Raises:
            LinkedPathError: a component of ``rel`` above its last one is a symbolic link.
        """
        self._retried(self._remove_once, rel, describe=f"remove {self.display(rel)}")

    def _remove_once(self, rel: str) -> None:
        if self.is_local:
            self._remove_local(rel, tree=False)
            return
        try:
            self.fs.rm_file(self.path(rel))
        except FileNotFoundError:
            pass

    def _remove_local(self, rel: str, tree: bool) -> None:
        parts = local.rel_parts(rel)
        if not parts:  # the root itself (the caller's path)
            if tree and os.path.isdir(self.root) and not os.path.islink(self.root):
                parent = os.open(os.path.dirname(self.root) or "/", os.O_RDONLY)
                try:
                    local.remove_tree_at(parent, os.path.basename(self.root))
                finally:
                    os.close(parent)
            return
        try:
            dir_fd = local.open_dir_below(self.root, parts[:-1])
        except (FileNotFoundError, NotADirectoryError):
            return
        try:
            if tree:
                local.remove_tree_at(dir_fd, parts[-1])
            else:
                try:
                    os.unlink(parts[-1], dir_fd=dir_fd)
                except FileNotFoundError:
                    pass
        finally:
            os.close(dir_fd)

    # -- helpers -------------------------------------------------------------------------------
    def _retried(self, fn: Callable[..., T], *args: Any, describe: str) -> T:
        return self.retry.call(fn, *args, describe=describe)

    def not_a_directory(self, rel: str) -> NotADirectoryError:
        """The error for ``rel`` (or the root, ``""``) being a file where a directory is needed."""
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
            raise self.not_a_directory("")
        self._root_checked = True


def _unreadable(exc: OSError, where: str, dir_fd: int, name: str) -> Exception:
    """What opening ``name`` for reading raised, as damage where it is not a regular file."""
    if exc.errno not in (errno.ELOOP, errno.ENXIO, errno.EMLINK, errno.EOPNOTSUPP):
        return exc
    try:
        mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
    except OSError:
        return exc
    return CorruptCheckpointError(f"{where} is not a regular file ({local.kind_of(mode)}); the checkpoint is damaged")
