"""Pointer files: what a Lightning checkpoint path holds when ``CheckpointdIO`` saved it.

Lightning's ``ModelCheckpoint`` thinks in files: it checks whether a path exists, lists ``last*.ckpt``,
links ``last.ckpt`` to the newest top-k file and removes the files it does not keep. ``CheckpointdIO``
keeps the checkpoint itself in a checkpointd root (one step directory per save, committed marker last)
and writes, at the path Lightning asked for, a small JSON pointer naming that step. The pointer is
written when the save starts, so every ``exists``/``ls``/link decision Lightning makes sees the file,
as with ``torch.save``; it names two saves:

- ``target``: the step this path holds once its save committed;
- ``fallback``: the newest checkpoint that had committed when the save started. A process killed
  before ``target`` committed leaves a pointer whose ``target`` is not a checkpoint; loading it gives
  ``fallback`` (with a warning), the state a synchronous writer would have left, so
  ``trainer.fit(ckpt_path="last")`` after a crash resumes from the newest complete checkpoint.

Each save is identified by ``(step, save_id)``; the id is recorded in the step's manifest metrics and
checked on load, so a step number reused after a crash (a save that never committed) never passes for
another save. The pointer is replaced atomically (a temporary file and ``os.replace`` on local disk;
a single object put elsewhere). Its bytes are untrusted input: they are parsed as JSON of a known
shape, never unpickled, and only read, never followed for deletion (``CheckpointdIO`` deletes steps only
under its own root).
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
from dataclasses import dataclass
from typing import Any

import fsspec

from checkpointd.errors import CheckpointNotFoundError, CorruptCheckpointError

POINTER_FORMAT = "checkpointd-lightning-pointer"
"""The ``format`` field that tells a pointer from a ``torch.save`` checkpoint."""
POINTER_VERSION = 1
MAX_POINTER_BYTES = 64 * 1024
"""A file larger than this is never a pointer (a pointer is a few hundred bytes)."""
SAVE_ID_METRIC = "lightning_save_id"
"""The manifest metric that holds a save's id."""


@dataclass(frozen=True)
class SaveRef:
    """One save under a checkpointd root."""

    step: int
    """The checkpointd step (a counter of saves, not Lightning's ``global_step``)."""
    save_id: str
    """Random hex id of the save, also in the step's manifest metrics (``SAVE_ID_METRIC``)."""


@dataclass(frozen=True)
class Pointer:
    """The content of a pointer file."""

    root: str
    """The checkpointd root: relative to the pointer's directory, an absolute path or a URL."""
    target: SaveRef
    fallback: SaveRef | None
    global_step: int | None = None
    """Lightning's ``global_step`` at the save, for people reading the file."""

    def to_bytes(self) -> bytes:
        doc: dict[str, Any] = {
            "format": POINTER_FORMAT, "version": POINTER_VERSION, "root": self.root,
            "step": self.target.step, "save_id": self.target.save_id,
            "fallback": None if self.fallback is None else {"step": self.fallback.step, "save_id": self.fallback.save_id},
            "global_step": self.global_step,
        }
        return (json.dumps(doc, indent=1) + "\n").encode()


def parse_pointer(data: bytes, where: str) -> Pointer | None:
    """The pointer in ``data``, or None when ``data`` is not a pointer (e.g. a ``torch.save`` file).

    Raises:
        CorruptCheckpointError: ``data`` claims to be a pointer but a field is missing or malformed.
    """
    if len(data) > MAX_POINTER_BYTES or not data.lstrip()[:1] == b"{":
        return None
    try:
        doc = json.loads(data.decode())
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != POINTER_FORMAT:
        return None
    if doc.get("version") != POINTER_VERSION:
        raise CorruptCheckpointError(f"{where}: checkpointd pointer version {doc.get('version')!r} is not supported "
                                     f"(this checkpointd reads version {POINTER_VERSION}); upgrade checkpointd")
    root = doc.get("root")
    if not isinstance(root, str) or not root:
        raise CorruptCheckpointError(f"{where}: checkpointd pointer has no valid 'root' ({root!r})")
    global_step = doc.get("global_step")
    return Pointer(root=root, target=_save_ref(doc, where, "pointer"),
                   fallback=None if doc.get("fallback") is None else _save_ref(doc["fallback"], where, "fallback"),
                   global_step=global_step if _is_count(global_step) else None)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _save_ref(doc: Any, where: str, what: str) -> SaveRef:
    step = doc.get("step") if isinstance(doc, dict) else None
    save_id = doc.get("save_id") if isinstance(doc, dict) else None
    if not _is_count(step):
        raise CorruptCheckpointError(f"{where}: checkpointd {what} 'step' must be a non-negative integer, got {step!r}")
    if not (isinstance(save_id, str) and 0 < len(save_id) <= 64 and all(c in "0123456789abcdef" for c in save_id)):
        raise CorruptCheckpointError(f"{where}: checkpointd {what} 'save_id' must be a hex string, got {save_id!r}")
    return SaveRef(step=step, save_id=save_id)


# -- paths -------------------------------------------------------------------------------------------
def is_local(path: str) -> bool:
    """Whether ``path`` is on the local file system (a plain path or a ``file://`` URL)."""
    return "://" not in path or path.startswith("file://")


def normalize(path: str | os.PathLike[str]) -> str:
    """``path`` as a string; local paths absolute (``file://`` stripped), URLs unchanged."""
    text = os.fspath(path)
    if text.startswith("file://"):
        text = text[len("file://"):]
    return os.path.abspath(text) if is_local(text) else text


def dirname(path: str) -> str:
    return os.path.dirname(path) if is_local(path) else path.rstrip("/").rsplit("/", 1)[0]


def join(base: str, name: str) -> str:
    return os.path.join(base, name) if is_local(base) else base.rstrip("/") + "/" + name


def root_as_stored(pointer_path: str, root: str) -> str:
    """How a pointer at ``pointer_path`` names ``root``: relative when both are local (the directory
    can then be moved or copied whole), else the absolute path or URL."""
    if is_local(pointer_path) and is_local(root):
        return os.path.relpath(root, os.path.dirname(pointer_path))
    return root


def resolve_root(pointer_path: str, stored: str) -> str:
    """The root a pointer at ``pointer_path`` names (relative roots from the file's real directory,
    so a ``last.ckpt`` link to a pointer elsewhere resolves like the pointer itself)."""
    if not is_local(stored) or os.path.isabs(stored):
        return normalize(stored)
    if is_local(pointer_path):
        return os.path.normpath(os.path.join(os.path.dirname(os.path.realpath(pointer_path)), stored))
    return join(dirname(pointer_path), stored)


# -- file I/O ----------------------------------------------------------------------------------------
def is_link(path: str) -> bool:
    return is_local(path) and os.path.islink(path)


def read_file_head(path: str) -> bytes | None:
    """The first ``MAX_POINTER_BYTES + 1`` bytes of the file at ``path`` (enough to tell a pointer).

    Raises:
        CheckpointNotFoundError: nothing at ``path``.
        CorruptCheckpointError: ``path`` is not a regular file (a FIFO is never opened).
    """
    if is_local(path):
        try:
            st = os.stat(path)
        except FileNotFoundError as exc:
            raise CheckpointNotFoundError(f"checkpoint file not found: {path}") from exc
        if not stat.S_ISREG(st.st_mode):
            raise CorruptCheckpointError(f"{path} is not a regular file; pass the checkpoint file Lightning wrote")
        with open(path, "rb") as f:
            return f.read(MAX_POINTER_BYTES + 1)
    fs, fs_path = fsspec.core.url_to_fs(path)
    if not fs.exists(fs_path):
        raise CheckpointNotFoundError(f"checkpoint file not found: {path}")
    with fs.open(fs_path, "rb") as f:
        return f.read(MAX_POINTER_BYTES + 1)


def read_pointer(path: str) -> Pointer | None:
    """The pointer at ``path``; None when the file there is something else (a ``torch.save`` file)."""
    head = read_file_head(path)
    return None if head is None else parse_pointer(head, path)


def write_pointer(path: str, pointer: Pointer) -> None:
    """Replace whatever is at ``path`` (a link too: the link, not its target) with ``pointer``, atomically."""
    data = pointer.to_bytes()
    if not is_local(path):
        fs, fs_path = fsspec.core.url_to_fs(path)
        fs.pipe_file(fs_path, data)  # one object put: appears whole or not at all
        return
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".ckpt-pointer-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise
    _fsync_dir(directory)


def remove_file(path: str) -> None:
    """Remove the file (or link) at ``path``; a missing one is not an error."""
    if is_local(path):
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
        return
    fs, fs_path = fsspec.core.url_to_fs(path)
    if fs.exists(fs_path):
        fs.rm(fs_path)


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


__all__ = ["MAX_POINTER_BYTES", "POINTER_FORMAT", "POINTER_VERSION", "SAVE_ID_METRIC", "Pointer", "SaveRef", "dirname",
           "is_link", "is_local", "join", "normalize", "parse_pointer", "read_file_head", "read_pointer", "remove_file",
           "resolve_root", "root_as_stored", "write_pointer"]
