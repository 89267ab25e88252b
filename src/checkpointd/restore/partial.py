"""Partial reads: one tensor of a large checkpoint, without reading the rest of its file.

:func:`load_tensor` and :func:`load_tensors` take a single file, a committed step directory or a
checkpoint root; :func:`open_file` opens a single file as a
:class:`checkpointd.restore.checkpoint_file.CheckpointFile`, which reads the pickle and then only the
records behind the tensors asked for. Local files are read plainly; files on object stores (S3, GCS)
through small read-ahead blocks, so only the ranges needed are fetched.

Integrity: a file of a committed step is streamed through its manifest checksum before its pickle is
parsed (nothing from a checkpoint root is parsed unverified; the data read is then only what the
tensors asked for need). A single file given by path has no manifest: its records' own checksums
(zip CRC-32, codec chunk checksums) are all there is.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import IO, Any

import torch

from checkpointd import commit
from checkpointd.errors import CheckpointNotFoundError
from checkpointd.format import layout
from checkpointd.restore.checkpoint_file import (
    CheckpointFile,
    KeyPath,
    join_key,
    split_key,
    )
from checkpointd.restore.verify import verify_file
from checkpointd.storage.store import Store

__all__ = ["codec_of", "format_of", "load_tensor", "load_tensors", "open_file", "open_in_store"]


def open_file(path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None,
              *, codec: str | None = None, fmt: str | None = None) -> CheckpointFile:
    """A single checkpoint file (local path or fsspec URL) opened for partial reads.

    Codec and format follow the name (``.zst`` suffix; ``.mdlus`` or ``.pt``) unless given.
    """
    store = Store(path, storage_options)
    if not store.is_file(""):
        raise CheckpointNotFoundError(f"{store.display()} is not a file")
    name = store.root.rsplit("/", 1)[-1]
    return open_in_store(store, "", codec or codec_of(name), fmt or format_of(name), store.display())


def load_tensor(path: str | os.PathLike[str], key: KeyPath, *, step: int | None = None,
                storage_options: dict[str, Any] | None = None) -> torch.Tensor:
    """One tensor of a checkpoint, reading only the bytes that hold it (plus the small pickle).

    Args:
        path: a single ``.pt``/``.mdlus`` file (optionally ``.zst``), a committed step directory, or a
            checkpoint root (its newest committed step, or ``step``).
        key: ``'/'``-separated path to the tensor. In a file, the path inside its object tree
            (``"optimizer_state_dict/state/0/exp_avg"``); in a step directory or root, it starts with
            the state name given to the manager (``"model/layers.0.weight"``, ``"opt/state/0/exp_avg"``).
            A sequence of parts works too, for keys that contain ``'/'``.
        step: which step of a root.
        storage_options: passed to fsspec.

    Raises:
        CheckpointNotFoundError: no such file, step or key (the message lists what exists).
        CorruptCheckpointError / IncompleteCheckpointError: damaged or uncommitted checkpoint.
        UnsafeCheckpointError: the file's pickle references code; nothing was run.
    """
    return load_tensors(path, [key], step=step, storage_options=storage_options)[join_key(split_key(key))]


def load_tensors(path: str | os.PathLike[str], keys: Sequence[KeyPath], *, step: int | None = None,
                 storage_options: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """Several tensors at once (see :func:`load_tensor`), each file opened once: ``{key: tensor}``."""
    store = Store(path, storage_options)
    parts = [split_key(k) for k in keys]
    if store.is_file(""):
        with open_file(path, storage_options) as f:
            return {join_key(p): f.load_tensor(p) for p in parts}
    step_dir = _resolve_step_dir(store, step)
    manifest = commit.read_committed_manifest(store, step_dir)
    by_file: dict[str, list[tuple[list[Any], list[Any]]]] = {}
    for p in parts:
        if not p or str(p[0]) not in manifest.entries:
            raise CheckpointNotFoundError(
                f"{store.display(step_dir)} has no state entry {str(p[0]) if p else ''!r}; entries: {sorted(manifest.entries)}"
            )
        loc = manifest.entries[str(p[0])]
        inner = ([loc.key] if loc.key is not None else []) + list(p[1:])
        by_file.setdefault(loc.file, []).append((p, inner))
    out: dict[str, torch.Tensor] = {}
    for rel, wanted in by_file.items():
        entry = manifest.file(rel)
        full = layout.join(step_dir, rel)
        verify_file(store, step_dir, entry)  # the whole file against its checksum before anything is parsed
        with open_in_store(store, full, entry.codec, entry.format, store.display(full)) as f:
            for p, inner in wanted:
                out[join_key(p)] = f.load_tensor(inner)
    return out


def open_in_store(store: Store, rel: str, codec: str, fmt: str, where: str) -> CheckpointFile:
    """File ``rel`` of ``store`` opened for partial reads (``where`` names it in messages)."""
    raw = _open_ranged(store, rel)
    try:
        return CheckpointFile(raw, codec=codec, fmt=fmt, where=where)
    except BaseException:
        raw.close()
        raise


def _open_ranged(store: Store, rel: str) -> IO[bytes]:
    """A seekable file for ranged reads: plain on local disk, small read-ahead blocks elsewhere."""
    if store.is_local:
        return store.open_read(rel)
    store.fs.invalidate_cache(store.path(rel))  # a listing's cached ETag would refuse a file rewritten since
    try:
        return store.retry.call(store.fs.open, store.path(rel), "rb", block_size=1 << 20, cache_type="readahead",
                                describe=f"open {store.display(rel)}")
    except TypeError:
        return store.open_read(rel)


def _resolve_step_dir(store: Store, step: int | None) -> str:
    names = store.list_dir("")
    if layout.MANIFEST_NAME in names or layout.COMMIT_MARKER_NAME in names:
        return ""
    steps = commit.committed_steps(store)
    if not steps:
        raise CheckpointNotFoundError(f"{store.display()} holds no committed checkpoint")
    chosen = steps[-1] if step is None else step
    if chosen not in steps:
        raise CheckpointNotFoundError(f"step {step} is not committed under {store.display()} (committed: {steps[-10:]})")
    return layout.step_dir_name(chosen)


def codec_of(name: str) -> str:
    """The codec a file's name implies: ``zstd`` for the ``.zst`` suffix, else ``none``."""
    return "zstd" if name.endswith(layout.ZSTD_SUFFIX) else "none"


def format_of(name: str) -> str:
    """The format a file's name implies (``mdlus`` or ``pt``), past any codec suffix."""
    base = name[: -len(layout.ZSTD_SUFFIX)] if name.endswith(layout.ZSTD_SUFFIX) else name
    return "mdlus" if base.endswith(".mdlus") else "pt"
