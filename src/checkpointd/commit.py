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
from typing import Callable

from . import layout
from .checksum import sha256_hex
from .errors import IncompleteCheckpointError, ManifestError
from .manifest import Manifest
from .storage import Store


def write_manifest_and_commit(store: Store, step_dir: str, manifest: Manifest) -> None:
    """Write ``manifest.json``, then the ``COMMITTED`` marker. Called from the background writer thread,
    after every data file of the step is durable."""
    data = manifest.to_json()
    store.write_bytes(layout.join(step_dir, layout.MANIFEST_NAME), data)
    marker = json.dumps({"manifest": layout.MANIFEST_NAME, "manifest_checksum": sha256_hex(data), "step": manifest.step})
    # IMPORTANT: the marker is the last write of a save; everything before it must be durable.
    store.write_bytes(layout.join(step_dir, layout.COMMIT_MARKER_NAME), marker.encode())


def is_committed(store: Store, step_dir: str) -> bool:
    """Whether ``step_dir`` holds a non-empty marker (no manifest or data read).

    An empty marker is what a process killed between creating and writing it leaves on local disk
    (object stores never show a partial object); it does not count, so such a step is an uncommitted
    leftover that retention and ``gc`` remove, never a "committed" step that fails to restore.
    """
    try:
        return store.size(layout.join(step_dir, layout.COMMIT_MARKER_NAME)) > 0
    except (FileNotFoundError, NotADirectoryError):
        return False


def read_committed_manifest(store: Store, step_dir: str) -> Manifest:
    """The manifest of a committed step, checked against its marker.

    Raises:
        IncompleteCheckpointError: no marker, or the marker does not match the manifest.
        ManifestError: unreadable manifest.
    """
    where = store.display(step_dir)
    try:
        marker_raw = store.read_bytes(layout.join(step_dir, layout.COMMIT_MARKER_NAME))
    except FileNotFoundError as exc:
        raise IncompleteCheckpointError(f"{where} has no {layout.COMMIT_MARKER_NAME} marker: the save never finished") from exc
    if not marker_raw:
        raise IncompleteCheckpointError(
            f"{where}/{layout.COMMIT_MARKER_NAME} is empty: the save was killed while committing; the step is not a checkpoint"
        )
    try:
        marker = json.loads(marker_raw)
        expected = marker["manifest_checksum"]
    except (ValueError, KeyError, TypeError) as exc:
        raise IncompleteCheckpointError(f"{where}/{layout.COMMIT_MARKER_NAME} is malformed ({exc!r})") from exc
    try:
        data = store.read_bytes(layout.join(step_dir, layout.MANIFEST_NAME))
    except FileNotFoundError as exc:
        raise IncompleteCheckpointError(f"{where} is marked committed but has no {layout.MANIFEST_NAME}") from exc
    if sha256_hex(data) != expected:
        raise IncompleteCheckpointError(
            f"{where}/{layout.MANIFEST_NAME} does not match the checksum in {layout.COMMIT_MARKER_NAME}: the manifest was altered or damaged"
        )
    manifest = Manifest.from_json(data, where=f"{where}/{layout.MANIFEST_NAME}")
    if layout.parse_step_dir_name(step_dir) not in (None, manifest.step):
        raise ManifestError(f"{where}/{layout.MANIFEST_NAME} is for step {manifest.step}, not this directory's step")
    return manifest


def uncommit_and_remove(store: Store, step_dir: str, recycle: Callable[[str], None] | None = None) -> None:
    """Delete a step directory: the marker first, so a crash mid-delete never leaves a 'committed' husk.

    ``recycle(step_dir)``, called between the two, may move files out for reuse
    (:class:`checkpointd.recycle.Retirement`): by then the directory is no longer a checkpoint.
    """
    store.remove(layout.join(step_dir, layout.COMMIT_MARKER_NAME))
    if recycle is not None:
        recycle(step_dir)
    store.remove_tree(step_dir)


def list_step_dirs(store: Store) -> dict[int, str]:
    """``{step: dir name}`` for every step-shaped directory under the root (committed or not)."""
    out: dict[int, str] = {}
    for name in store.list_dir(""):
        step = layout.parse_step_dir_name(name)
        if step is not None:
            out[step] = name
    return out


def committed_steps(store: Store) -> list[int]:
    """Committed steps, ascending, from one listing of the root (no manifest or data read).

    One recursive prefix listing (``fs.find``), retried under ``store.retry``: on S3/GCS that is one
    paginated LIST of the prefix (1,000 keys a request), instead of a HEAD per step directory or a
    glob, which fsspec turns into one listing per directory. Only a non-empty
    ``<root>/step-N/COMMITTED`` counts (see :func:`is_committed`).
    """
    return store.retry.call(_committed_steps_once, store, describe=f"list {store.display()}")


def _committed_steps_once(store: Store) -> list[int]:
    root = store.root.rstrip("/")
    if not store.is_local:
        store.fs.invalidate_cache(root)
    try:
        hits = store.fs.find(root, detail=True)
    except FileNotFoundError:
        return []
    steps = set()
    for hit, info in hits.items():
        rel = store.fs._strip_protocol(hit).rstrip("/")[len(root):].strip("/")
        parts = rel.split("/")
        # an empty marker is a save killed while committing (see is_committed): not committed
        if len(parts) == 2 and parts[1] == layout.COMMIT_MARKER_NAME and info.get("size", 1) != 0:
            step = layout.parse_step_dir_name(parts[0])
            if step is not None:
                steps.add(step)
    return sorted(steps)
