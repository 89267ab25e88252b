"""The whole values of a committed step, as ``checkpointd.load`` gives them, for the DCP and safetensors exports.

Full-mode steps are read file by file (only the files holding the wanted entries); sharded steps read
every rank's file and are assembled into whole tensors (:func:`checkpointd.restore.assemble.assemble_full_values`),
whatever the world size that wrote them. Every file is verified against the manifest before it is parsed,
and parsed with the weights-only unpickler.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable
from typing import Any

from checkpointd.errors import ConfigError
from checkpointd.format import layout
from checkpointd.format.dequantize import dequantize_tree
from checkpointd.format.manifest import FileEntry, Manifest
from checkpointd.format.subclasses import subclass_paths
from checkpointd.restore.assemble import assemble_full_values
from checkpointd.restore.step import (decode, fast_read_applies, load_native, malformed_is_damage, read_local_fast,
                                      read_step, read_verified, values_by_entry)
from checkpointd.storage.store import Store

__all__ = ["plain_values", "step_values"]

logger = logging.getLogger("checkpointd")


def step_values(store: Store, step_dir: str, manifest: Manifest, names: Iterable[str] | None = None,
                on_bytes: Callable[[int], None] | None = None) -> dict[str, Any]:
    """``{state name: stored value}`` of the entries ``names`` (all by default), every tensor whole and on the CPU.

    Args:
        manifest: the step's committed manifest (``commit.read_committed_manifest``).
        on_bytes: called with each file's stored size once it is read (progress).

    Raises:
        CorruptCheckpointError / UnsafeCheckpointError: a file fails verification or holds unsafe or
            malformed content.
    """
    wanted = Manifest(**{f.name: getattr(manifest, f.name) for f in dataclasses.fields(manifest)})
    if names is not None:
        wanted.entries = {n: manifest.entries[n] for n in names}
    with malformed_is_damage(store.display(step_dir)):
        if manifest.mode == "sharded":
            contents = read_step(store, step_dir, manifest, rank=None)
            if on_bytes is not None:
                on_bytes(sum(f.size for f in manifest.files))
            return assemble_full_values(wanted, contents)
        files = {loc.file for loc in wanted.entries.values()}
        contents = {}
        for entry in manifest.files:
            if entry.path in files:
                contents[entry.path] = _read_file(store, step_dir, entry)
                if on_bytes is not None:
                    on_bytes(entry.size)
        return values_by_entry(wanted, contents)


def _read_file(store: Store, step_dir: str, entry: FileEntry) -> Any:
    if fast_read_applies(store, entry):
        return read_local_fast(store, step_dir, entry)
    where = store.display(layout.join(step_dir, entry.path))
    return load_native(decode(entry.codec, read_verified(store, step_dir, entry), where), entry.format, where)


def plain_values(values: dict[str, Any], manifest: Manifest, fmt: str, dequantize: bool) -> dict[str, Any]:
    """``values`` ready for a format that holds plain tensors only (DCP, safetensors).

    A step holding tensor subclasses (torchao's quantized tensors, found in the values: a sharded step's
    are assembled from every rank's blocks) is refused unless ``dequantize`` is set; then each becomes the
    plain tensor its class computes (:func:`checkpointd.format.dequantize.dequantize_tree`), not
    bit-exact, and a warning names them.

    Raises:
        ConfigError: subclasses and ``dequantize`` False, or a class that cannot be dequantized.
    """
    listed = subclass_paths(values)
    if not listed:
        return values
    if not dequantize:
        raise ConfigError(f"step {manifest.step} holds {len(listed)} tensor subclass value(s) (quantized tensors, e.g. "
                          f"{sorted(listed)[:3]}), which --format {fmt} cannot hold: pass --dequantize "
                          "(dequantize=True) for plain, NOT bit-exact tensors, or export --format native (exact)")
    done: dict[str, str] = {}
    out = dequantize_tree(values, (), done)
    logger.warning("checkpointd: export --format %s --dequantize wrote %d tensor subclass value(s) as plain "
                   "dequantized tensors, which are not bit-exact copies of the saved values: %s",
                   fmt, len(done), sorted(done)[:5])
    return out
