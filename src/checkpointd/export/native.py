"""``checkpointd export`` (``--format native``): a committed step back to native, uncompressed PhysicsNeMo-style files.

Every data file of the step is read, checked against the manifest (size and CRC-32, as on restore),
its pickle is parsed with the weights-only unpickler (an unsafe file is refused before anything is
written for it), and its decoded bytes are streamed to ``OUT_DIR`` under the native name (the ``.zst``
suffix dropped). No manifest and no marker are written: the result is a plain directory that
``torch.load(weights_only=True)``, ``Module.from_checkpoint`` and PhysicsNeMo's ``load_checkpoint`` read.

Memory: one file's stored (compressed) bytes at a time; decoded bytes are streamed in blocks.
If any file fails, the files this call already wrote are removed again.
"""

from __future__ import annotations

import io
from collections.abc import Callable

from checkpointd import commit
from checkpointd.codecs.compress import get_codec
from checkpointd.format import layout
from checkpointd.errors import CheckpointError, ConfigError, CorruptCheckpointError
from checkpointd.export.result import ExportedFile
from checkpointd.format.subclasses import check_described, check_sharded_described
from checkpointd.restore.checkpoint_file import CheckpointFile
from checkpointd.restore.step import read_verified
from checkpointd.storage.store import Store

__all__ = ["BLOCK_BYTES", "export_native", "native_name"]

BLOCK_BYTES = 8 << 20


def native_name(rel: str) -> str:
    """``Linear.0.10.pt.zst`` -> ``Linear.0.10.pt``."""
    return rel[: -len(layout.ZSTD_SUFFIX)] if rel.endswith(layout.ZSTD_SUFFIX) else rel


def export_native(store: Store, step_dir: str, out: Store, *, overwrite: bool = False,
                  on_bytes: Callable[[int], None] | None = None) -> list[ExportedFile]:
    """Write the native files of the committed step ``step_dir`` of ``store`` into ``out``.

    Raises:
        IncompleteCheckpointError / ManifestError: the step is not committed or its manifest is bad.
        CorruptCheckpointError: a file fails its checksum or cannot be decoded.
        UnsafeCheckpointError: a file's pickle references code; nothing of that file was written.
        UnacceptedSubclassError: the manifest names a tensor subclass this process has not imported or
            does not accept; nothing was read.
        ConfigError: a target file exists and ``overwrite`` is False.
    """
    manifest = commit.read_committed_manifest(store, step_dir)
    check_described(manifest.extra.get("subclasses"), step_dir)  # before any pickle runs: what to import
    check_sharded_described(manifest.extra.get("sharded"), step_dir)
    targets = {f.path: native_name(f.path) for f in manifest.files}
    if not overwrite:
        existing = [t for t in targets.values() if out.exists(t)]
        if existing:
            raise ConfigError(f"{out.display(existing[0])} already exists ({len(existing)} of the files); "
                              "pass --overwrite or choose an empty OUT_DIR")
    written: list[str] = []
    results = []
    try:
        for entry in manifest.files:
            where = store.display(layout.join(step_dir, entry.path))
            data = read_verified(store, step_dir, entry)
            with CheckpointFile(io.BytesIO(data), codec=entry.codec, fmt=entry.format, where=where) as f:
                f.structure()  # refuses unsafe pickles before a byte of this file is written
            target = targets[entry.path]
            written.append(target)
            native = _write_decoded(data, entry.codec, out, target, where, entry.raw_size)
            if entry.raw_size is not None and native != entry.raw_size:
                raise CorruptCheckpointError(f"{where} decodes to {native} bytes, the manifest says {entry.raw_size}")
            if on_bytes is not None:
                on_bytes(entry.size)
            results.append(ExportedFile(source=where, target=out.display(target), stored_bytes=entry.size, native_bytes=native))
    except BaseException:
        for target in written:
            try:
                out.remove(target)
            except OSError:
                pass
        raise
    return results


def _write_decoded(data: bytes, codec_name: str, out: Store, target: str, where: str, limit: int | None = None) -> int:
    """Stream the native bytes of ``data`` into ``out/target``; returns how many were written.

    A stream that decodes to more than ``limit`` bytes (the manifest's native size) is refused as soon
    as it passes it, so a crafted frame cannot fill the disk.
    """
    if codec_name in ("none", "", None):
        out.write_bytes(target, data)
        return len(data)
    total = 0
    try:
        with get_codec(codec_name).open_decoded(io.BytesIO(data)) as src, out.open_write(target) as dst:
            while True:
                block = src.read(BLOCK_BYTES)
                if not block:
                    break
                dst.write(block)
                total += len(block)
                if limit is not None and total > limit:
                    raise CorruptCheckpointError(f"{where} decodes to more than the {limit} bytes the manifest says")
    except CheckpointError:
        raise
    except (ValueError, EOFError) as exc:
        raise CorruptCheckpointError(f"{where} could not be decoded with codec {codec_name!r}: {exc}") from exc
    return total
