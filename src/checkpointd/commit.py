"""Marker-last commit: the one rule that makes a checkpoint exist (SPEC §2 "Commit").

A checkpoint exists if and only if ``<step dir>/COMMITTED`` exists and names the SHA-256 of the
``manifest.json`` beside it, and that manifest's files verify. The marker is written after every data
file and the manifest are durable (``close()`` of a Store file fsyncs on local disk; an object store
makes an object visible only once its upload completed). Nothing relies on rename being atomic, so the
same protocol is correct on local disk, S3, GCS and memory://.

Deleting goes the other way: the marker first, then the rest, so a half-deleted directory is never
taken for a checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
import threading
import time
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from checkpointd.format import layout
from checkpointd.codecs.checksum import sha256_hex
from checkpointd.errors import CheckpointError, IncompleteCheckpointError, ManifestError
from checkpointd.format.manifest import Manifest
from checkpointd.storage.store import Store

logger = logging.getLogger("checkpointd")


def write_manifest_and_commit(store: Store, step_dir: str, manifest: Manifest,
                              before_marker: Callable[[], None] | None = None) -> None:
    """Write ``manifest.json``, then the ``COMMITTED`` marker. Called from the background writer thread,
    after every data file of the step is durable.

    ``before_marker()`` runs just before the marker is written and may raise to keep the step
    uncommitted (:meth:`checkpointd.lease.RootLease.check`: another writer took the root over).
    """
    data = manifest.to_json()
    store.write_bytes(layout.join(step_dir, layout.MANIFEST_NAME), data)
    marker = json.dumps({"manifest": layout.MANIFEST_NAME, "manifest_checksum": sha256_hex(data), "step": manifest.step})
    if before_marker is not None:
        before_marker()
    # IMPORTANT: the marker is the last write of a save; everything before it must be durable.
    store.write_bytes(layout.join(step_dir, layout.COMMIT_MARKER_NAME), marker.encode())


MAX_MARKER_BYTES = 4096
MAX_MANIFEST_BYTES = 256 << 20
"""Larger markers and manifests are damage (or an attack), never read into memory."""
_SHA256_RE = re.compile(r"sha256:[0-9a-f]{64}")


def _read_small(store: Store, rel: str, limit: int, what: str) -> bytes:
    """A marker or manifest, refused before reading when it is not a regular file or larger than ``limit``.

    Raises:
        FileNotFoundError: it does not exist.
        IncompleteCheckpointError: anything else that keeps it from being read (a directory, a FIFO, a
            link out of the root, too large, unreadable).
    """
    where = store.display(rel)
    try:
        if store.is_local:  # a stat, then the read (which refuses anything but a regular file)
            size = store.size(rel)
            if size > limit:
                raise IncompleteCheckpointError(f"{where} has {size} bytes, more than a {what} can have: the step is damaged")
            data = store.read_bytes(rel)
        else:  # one ranged request, whatever the object's size
            full = store.path(rel)
            data = bytes(store.retry.call(lambda: store.fs.cat_file(full, start=0, end=limit + 1), describe=f"read {where}"))
    except FileNotFoundError:
        raise
    except CheckpointError as exc:
        if isinstance(exc, IncompleteCheckpointError):
            raise
        raise IncompleteCheckpointError(f"{where} cannot be read as a {what}: {exc}") from exc
    except (OSError, ValueError) as exc:
        raise IncompleteCheckpointError(f"{where} cannot be read as a {what} ({type(exc).__name__}: {exc})") from exc
    if len(data) > limit:
        raise IncompleteCheckpointError(f"{where} has more bytes than a {what} can have: the step is damaged")
    return data


def read_marker(store: Store, step_dir: str) -> tuple[str, int]:
    """``(manifest SHA-256, step)`` named by ``step_dir``'s marker, checked against the directory's name.

    Raises:
        IncompleteCheckpointError: no marker, an empty one (a save killed while committing), or one that
            is malformed or names another step.
    """
    where = store.display(layout.join(step_dir, layout.COMMIT_MARKER_NAME))
    try:
        raw = _read_small(store, layout.join(step_dir, layout.COMMIT_MARKER_NAME), MAX_MARKER_BYTES, "commit marker")
    except (FileNotFoundError, NotADirectoryError) as exc:
        raise IncompleteCheckpointError(f"{store.display(step_dir)} has no {layout.COMMIT_MARKER_NAME} marker: the save never finished") from exc
    if not raw:
        raise IncompleteCheckpointError(f"{where} is empty: the save was killed while committing; the step is not a checkpoint")
    try:
        marker = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        marker = None
    checksum = marker.get("manifest_checksum") if isinstance(marker, dict) else None
    step = marker.get("step") if isinstance(marker, dict) else None
    if (not isinstance(checksum, str) or not _SHA256_RE.fullmatch(checksum) or type(step) is not int
            or marker.get("manifest") != layout.MANIFEST_NAME):
        raise IncompleteCheckpointError(f"{where} is not a valid commit marker; the step is not a checkpoint")
    dir_step = layout.parse_step_dir_name(step_dir)
    if dir_step is not None and dir_step != step:
        raise IncompleteCheckpointError(f"{where} names step {step}, not this directory's step {dir_step}")
    return checksum, step


def _manifest_bytes(store: Store, step_dir: str, expected: str | None = None) -> bytes:
    """The manifest's bytes, checked against the marker's SHA-256 (``expected``, read from the marker
    when not given; nothing parsed)."""
    if expected is None:
        expected, _ = read_marker(store, step_dir)
    where = store.display(step_dir)
    try:
        data = _read_small(store, layout.join(step_dir, layout.MANIFEST_NAME), MAX_MANIFEST_BYTES, "manifest")
    except (FileNotFoundError, NotADirectoryError) as exc:
        raise IncompleteCheckpointError(f"{where} is marked committed but has no {layout.MANIFEST_NAME}") from exc
    if sha256_hex(data) != expected:
        raise IncompleteCheckpointError(
            f"{where}/{layout.MANIFEST_NAME} does not match the checksum in {layout.COMMIT_MARKER_NAME}: the manifest was altered or damaged"
        )
    return data


def is_committed(store: Store, step_dir: str) -> bool:
    """Whether ``step_dir`` is committed: its marker names it and matches its manifest (nothing parsed).

    An empty marker is what a process killed between creating and writing it leaves on local disk
    (object stores never show a partial object); like a marker with other content, it does not count,
    so such a step is an uncommitted leftover that retention and ``gc`` remove.
    """
    try:
        _manifest_bytes(store, step_dir)
        return True
    except IncompleteCheckpointError:
        return False


def read_committed_manifest(store: Store, step_dir: str) -> Manifest:
    """The manifest of a committed step, checked against its marker, then parsed and validated.

    Raises:
        IncompleteCheckpointError: no marker, or the marker does not match the manifest.
        ManifestError: a malformed manifest, or one for another step.
    """
    where = store.display(step_dir)
    manifest = Manifest.from_json(_manifest_bytes(store, step_dir), where=f"{where}/{layout.MANIFEST_NAME}")
    _, marker_step = read_marker(store, step_dir)
    if manifest.step != marker_step:
        raise ManifestError(f"{where}/{layout.MANIFEST_NAME} is for step {manifest.step}, not step {marker_step} as its marker says")
    return manifest


def uncommit_and_remove(store: Store, step_dir: str, recycle: Callable[[str], None] | None = None) -> None:
    """Delete a step directory: the marker first, so a crash mid-delete never leaves a 'committed' husk.

    ``recycle(step_dir)``, called between the two, may move files out for reuse
    (:class:`checkpointd.storage.recycle.Retirement`): by then the directory is no longer a checkpoint.
    """
    if store.is_link(step_dir):  # a link planted in the root: removed as a link, never followed
        store.remove_tree(step_dir)
        return
    store.remove(layout.join(step_dir, layout.COMMIT_MARKER_NAME))
    if recycle is not None:
        recycle(step_dir)
    store.remove_tree(step_dir)


DAMAGED_DIR = ".checkpointd-damaged"
"""Where steps that failed verification during a restore are kept for inspection (never listed as steps)."""


def quarantine(store: Store, step_dir: str, reason: str) -> str | None:
    """Take a step that failed verification out of the checkpoints, keeping its files for inspection.

    The marker is removed first (the step stops being committed at once, even if what follows fails),
    then the directory moves to ``<root>/.checkpointd-damaged/<step dir>-<UTC time>/`` with the
    reason in ``DAMAGED.txt``. Nothing happens when the marker is gone or changed meanwhile: the
    step's writer deleted or rewrote it (retention, ``overwrite=True``), so the failure was theirs.
    Returns the new location relative to the root, or None when nothing was moved.
    """
    try:
        expected, _ = read_marker(store, step_dir)
    except IncompleteCheckpointError:
        return None
    where = store.display(step_dir)
    dest = layout.join(DAMAGED_DIR, f"{step_dir}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{uuid.uuid4().hex[:6]}")
    try:
        if read_marker(store, step_dir)[0] != expected:
            return None
        store.remove(layout.join(step_dir, layout.COMMIT_MARKER_NAME))
        _move_dir(store, step_dir, dest)
        store.write_bytes(layout.join(dest, "DAMAGED.txt"),
                          f"{step_dir} failed verification during a restore and was moved here:\n{reason}\n".encode())
    except (OSError, CheckpointError) as exc:
        logger.warning("checkpointd: %s failed verification; could not move it aside (%s): it stays as an "
                       "uncommitted directory", where, exc)
        return None
    logger.warning("checkpointd: %s failed verification and is no longer a checkpoint; its files are kept in %s",
                   where, store.display(dest))
    return dest


def _move_dir(store: Store, src: str, dest: str) -> None:
    """Move a step directory inside the root: a rename on local disk (never through a symbolic link),
    a server-side copy and delete on object stores."""
    if store.is_local:
        full = store.path(src)
        if os.path.islink(full) or not os.path.isdir(full):
            raise NotADirectoryError(f"{store.display(src)} is not a directory of the root")
        store.makedirs(DAMAGED_DIR)
        if os.path.islink(store.path(DAMAGED_DIR)):
            raise NotADirectoryError(f"{store.display(DAMAGED_DIR)} is a symbolic link; remove it")
        os.rename(full, store.path(dest))
    else:
        store.fs.mv(store.path(src), store.path(dest), recursive=True)
        store.remove_tree(src)


def list_step_dirs(store: Store) -> dict[int, str]:
    """``{step: dir name}`` for every step-shaped directory under the root (committed or not)."""
    out: dict[int, str] = {}
    for name in store.list_dir(""):
        step = layout.parse_step_dir_name(name)
        if step is not None:
            out[step] = name
    return out


def committed_steps(store: Store) -> list[int]:
    """Committed steps, ascending: one listing of the root, then each step's marker checked against its
    manifest (:func:`is_committed`), once per version of the two files.

    Local roots are listed with ``os.scandir`` (a step directory or marker that is a symbolic link, or
    not a directory / regular file, is not a step); object stores with one recursive prefix listing
    (``fs.find``: one paginated LIST of the prefix, 1,000 keys a request), retried under ``store.retry``.
    A step whose marker and manifest are unchanged since the last check (same size and modification
    time, or ETag) is not read again, so listing a root costs two small reads per new step only.
    """
    return store.retry.call(_steps_once, store, _COMMITTED, describe=f"list {store.display()}")


def candidate_steps(store: Store) -> list[int]:
    """Steps whose directory holds a non-empty marker, ascending, from the listing alone (no read).

    A superset of :func:`marked_steps`: what a caller checks one step at a time (:func:`is_committed`,
    :func:`has_valid_marker`) when it needs only a few of them, e.g. the newest.
    """
    def once() -> list[int]:
        return sorted(_local_candidates(store) if store.is_local else _listed_candidates(store))

    return store.retry.call(once, describe=f"list {store.display()}")


def has_valid_marker(store: Store, step_dir: str) -> bool:
    """Whether ``step_dir``'s marker is a valid marker naming it (whether or not its manifest matches)."""
    try:
        read_marker(store, step_dir)
        return True
    except IncompleteCheckpointError:
        return False


def marked_steps(store: Store) -> list[int]:
    """Steps whose marker is a valid marker naming them, ascending, whether or not the manifest matches.

    A superset of :func:`committed_steps`: what a restore tries (and quarantines when it fails to
    verify, see :func:`quarantine`) and what ``checkpointd verify`` checks. A marker that is not valid
    (empty, partly written, garbage) makes no step: a save may still be writing it.
    """
    return store.retry.call(_steps_once, store, _MARKED, describe=f"list {store.display()}")


_NONE, _MARKED, _COMMITTED = 0, 1, 2
_checked: "weakref.WeakKeyDictionary[Store, dict[int, tuple[Any, int]]]" = weakref.WeakKeyDictionary()
_checked_lock = threading.Lock()


def _marker_state(store: Store, step_dir: str) -> int:
    """_NONE, _MARKED or _COMMITTED: two reads, the marker's and the manifest's."""
    try:
        expected, _ = read_marker(store, step_dir)
    except IncompleteCheckpointError:
        return _NONE
    try:
        _manifest_bytes(store, step_dir, expected)
    except IncompleteCheckpointError:
        return _MARKED
    return _COMMITTED


CHECK_THREADS = 16
"""Markers and manifests read at once when many steps are new to a listing (object stores: one request each)."""


def _steps_once(store: Store, at_least: int) -> list[int]:
    candidates = _local_candidates(store) if store.is_local else _listed_candidates(store)
    with _checked_lock:
        seen = _checked.setdefault(store, {})
    new = [(step, name, version) for step, (name, version) in candidates.items()
           if (known := seen.get(step)) is None or known[0] != version]
    if len(new) > 1 and not store.is_local:
        with ThreadPoolExecutor(max_workers=min(CHECK_THREADS, len(new)), thread_name_prefix="checkpointd-list") as pool:
            states = list(pool.map(lambda item: _marker_state(store, item[1]), new))
    else:
        states = [_marker_state(store, name) for _, name, _ in new]
    for (step, _, version), state in zip(new, states):
        seen[step] = (version, state)
    return sorted(step for step in candidates if seen[step][1] >= at_least)


def _local_candidates(store: Store) -> dict[int, tuple[str, Any]]:
    """``{step: (dir name, version of marker and manifest)}`` for real step directories with a non-empty
    regular marker (``lstat``: links are not followed)."""
    out: dict[int, tuple[str, Any]] = {}
    try:
        entries = list(os.scandir(store.root))
    except (FileNotFoundError, NotADirectoryError):
        return out
    for entry in entries:
        step = layout.parse_step_dir_name(entry.name)
        if step is None or not entry.is_dir(follow_symlinks=False):
            continue
        try:
            marker = os.lstat(os.path.join(entry.path, layout.COMMIT_MARKER_NAME))
        except OSError:
            continue
        try:
            manifest: Any = os.lstat(os.path.join(entry.path, layout.MANIFEST_NAME))
            manifest = (manifest.st_mode, manifest.st_ino, manifest.st_size, manifest.st_mtime_ns)
        except OSError:
            manifest = None  # a valid marker without its manifest: damage, found by the check
        if stat.S_ISREG(marker.st_mode) and marker.st_size > 0:
            out[step] = (entry.name, (marker.st_ino, marker.st_size, marker.st_mtime_ns, manifest))
    return out


def _listed_candidates(store: Store) -> dict[int, tuple[str, Any]]:
    root = store.root.rstrip("/")
    store.fs.invalidate_cache(root)
    try:
        hits = store.fs.find(root, detail=True)
    except FileNotFoundError:
        return {}
    files: dict[tuple[str, str], Any] = {}
    for hit, info in hits.items():
        parts = store.fs._strip_protocol(hit).rstrip("/")[len(root):].strip("/").split("/")
        if len(parts) == 2 and parts[1] in (layout.COMMIT_MARKER_NAME, layout.MANIFEST_NAME) and info.get("type", "file") == "file":
            files[(parts[0], parts[1])] = (info.get("size"), info.get("ETag") or info.get("LastModified") or info.get("mtime")
                                           or info.get("created"))
    out: dict[int, tuple[str, Any]] = {}
    for (name, base), version in files.items():
        step = layout.parse_step_dir_name(name)
        manifest = files.get((name, layout.MANIFEST_NAME))
        # an empty marker is a save killed while committing (see is_committed): not committed
        if base == layout.COMMIT_MARKER_NAME and step is not None and version[0] != 0:
            out[step] = (name, (version, manifest))
    return out
