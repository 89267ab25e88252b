"""Verification of committed checkpoints, shared by restore and ``checkpointd verify``.

What "verifies" means (SPEC §2 "Commit"): the ``COMMITTED`` marker names the SHA-256 of the
``manifest.json`` beside it, the manifest is readable by this version, and every file it lists exists
with exactly the listed size and CRC-32. :func:`check_file` is the one place that compares a file with
its manifest entry; restore calls it on the bytes it has read, :func:`verify_file` on bytes streamed
in blocks (bounded memory, progress reporting).

``deep=True`` additionally decodes every file (codec frame checksums), reads every record (zip
CRC-32s) and parses every pickle with the weights-only unpickler, so an unsafe file is reported too.

Files in the step directory that the manifest does not list are reported as warnings: they do not
make a checkpoint invalid (nothing reads them), but they are not part of it either.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from checkpointd import commit
from checkpointd.codecs.checksum import ChecksumReader
from checkpointd.errors import CheckpointError, CorruptCheckpointError
from checkpointd.format import layout
from checkpointd.format.manifest import FileEntry, Manifest
from checkpointd.restore.checkpoint_file import CheckpointFile
from checkpointd.storage.store import Store

__all__ = ["StepReport", "check_file", "verify_file", "verify_root", "verify_step"]

BLOCK_BYTES = 8 << 20
"""Read size while streaming a file through its checksum."""

ProgressFn = Callable[[int], None]
"""Called with a number of bytes just processed."""


@dataclass
class StepReport:
    """The outcome of verifying one step directory."""

    step: int | None
    path: str
    """The step directory as the user should see it."""
    committed: bool
    ok: bool = False
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    files: int = 0
    """Data files checked."""
    nbytes: int = 0
    """Bytes read while checking."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_file(where: str, entry: FileEntry, nbytes: int, checksum: str) -> None:
    """Compare a file's size and checksum with its manifest entry.

    Raises:
        CorruptCheckpointError: they differ (the message says which and how).
    """
    if nbytes != entry.size:
        raise CorruptCheckpointError(f"{where} has {nbytes} bytes, the manifest says {entry.size}: truncated or altered")
    if checksum != entry.checksum:
        raise CorruptCheckpointError(f"{where} fails its checksum ({checksum} != {entry.checksum}): the file is damaged")


def verify_file(store: Store, step_dir: str, entry: FileEntry, on_bytes: ProgressFn | None = None) -> int:
    """Stream one file through CRC-32 and compare with its manifest entry; returns bytes read.

    Raises:
        CorruptCheckpointError: missing, wrong size, or wrong checksum.
    """
    rel = layout.join(step_dir, entry.path)
    where = store.display(rel)
    reader = ChecksumReader()
    try:
        with store.open_read(rel) as f:
            while True:
                block = f.read(BLOCK_BYTES)
                if not block:
                    break
                reader.update(block)
                if on_bytes is not None:
                    on_bytes(len(block))
                if reader.nbytes > entry.size:
                    break  # longer than listed: no need to read the rest
    except FileNotFoundError as exc:
        raise CorruptCheckpointError(f"{where} is listed in the manifest but missing") from exc
    if reader.nbytes > entry.size:
        reader.nbytes = store.size(rel)
    check_file(where, entry, reader.nbytes, reader.checksum)
    return reader.nbytes


def deep_check_file(store: Store, step_dir: str, entry: FileEntry) -> Any:
    """Decode one (already checksummed) file and read every record through the safe unpickler; returns
    its content.

    Raises:
        CorruptCheckpointError: a chunk or record fails its own checksum, or the container is damaged.
        UnsafeCheckpointError: the pickle references code outside the weights-only allow-list.
    """
    rel = layout.join(step_dir, entry.path)
    data = store.read_bytes(rel)
    with CheckpointFile(io.BytesIO(data), codec=entry.codec, fmt=entry.format, where=store.display(rel)) as f:
        return f.load()


def verify_step(store: Store, step_dir: str, *, deep: bool = False, on_bytes: ProgressFn | None = None) -> StepReport:
    """Verify one step directory (relative to ``store``'s root; ``""`` for the root itself).

    Never raises for a bad checkpoint: every problem goes into the report's ``errors``.
    """
    report = StepReport(step=layout.parse_step_dir_name(step_dir or store.root), path=store.display(step_dir),
                        committed=commit.is_committed(store, step_dir))
    try:
        manifest = commit.read_committed_manifest(store, step_dir)
    except CheckpointError as exc:
        report.errors.append(str(exc))
        return report
    report.step = manifest.step
    contents: dict[str, Any] = {}
    for entry in manifest.files:
        try:
            report.nbytes += verify_file(store, step_dir, entry, on_bytes)
            if deep:
                contents[entry.path] = deep_check_file(store, step_dir, entry)
        except CheckpointError as exc:
            report.errors.append(str(exc))
        except OSError as exc:
            report.errors.append(f"{store.display(layout.join(step_dir, entry.path))} cannot be read: {exc}")
        report.files += 1
    if deep and not report.errors:
        report.errors.extend(_missing_entries(store, step_dir, manifest, contents))
    report.warnings.extend(_unlisted_files(store, step_dir, manifest))
    report.ok = not report.errors
    return report


def verify_root(store: Store, *, deep: bool = False, on_bytes: ProgressFn | None = None) -> list[StepReport]:
    """Verify every step under a root that has a valid commit marker, ascending: a step whose manifest no
    longer matches its marker is reported as failing. Directories without a valid marker (uncommitted
    leftovers, a save in progress) are skipped."""
    return [verify_step(store, layout.step_dir_name(s), deep=deep, on_bytes=on_bytes) for s in commit.marked_steps(store)]


def stored_bytes(manifest: Manifest) -> int:
    return sum(f.size for f in manifest.files)


def _missing_entries(store: Store, step_dir: str, manifest: Manifest, contents: dict[str, Any]) -> list[str]:
    """Each state entry the manifest places under a key of a file that the file does not hold."""
    out = []
    for name, loc in manifest.entries.items():
        content = contents.get(loc.file)
        if loc.key is not None and not (isinstance(content, dict) and loc.key in content):
            out.append(f"{store.display(layout.join(step_dir, loc.file))} has no key {loc.key!r} for state entry {name!r}")
    return out


def _unlisted_files(store: Store, step_dir: str, manifest: Manifest) -> list[str]:
    listed = {f.path for f in manifest.files} | {layout.MANIFEST_NAME, layout.COMMIT_MARKER_NAME}
    base = store.path(step_dir).rstrip("/") + "/"
    try:
        found = [p[len(base):] if p.startswith(base) else p for p in store.fs.find(store.path(step_dir))]
    except OSError:
        return []
    return [f"{store.display(layout.join(step_dir, rel))} is not listed in the manifest (ignored; not part of the checkpoint)"
            for rel in sorted(found) if rel not in listed]
