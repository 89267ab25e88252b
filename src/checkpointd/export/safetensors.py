"""``checkpointd export --format safetensors``: each nn.Module entry's weights as ``<entry>.safetensors``.

One file per state entry the manifest marks as a module (``kind == "module"``), named after the entry
(``{"model": net}`` -> ``model.safetensors``), for ``safetensors.torch.load_file`` and
``model.load_state_dict``. Tensor names are the module's ``state_dict()`` keys, unchanged. The
optimizer and the other entries are not model weights: export them with ``--format dcp`` or ``native``.

What the safetensors format asks for, and what this export does about it:

- **Shared storage** (tied weights: ``head.weight is embed.weight``) is refused by safetensors. Every
  tensor that shares its storage with another key is **cloned**, so the file holds each key once, in
  full, and ``model.load_state_dict(load_file(path))`` works with ``strict=True`` (the tied tensor is
  simply written twice; ``safetensors.torch.save_model`` would drop one name instead).
- **Contiguity**: every tensor is written contiguous (a channels_last weight is written in the default
  layout; ``load_state_dict`` copies it back into the live channels_last parameter unchanged).
- **Non-tensor values** of a state dict (``_extra_state`` of a module that stores a Python object) cannot
  be stored: they are left out, named in :attr:`ExportedFile.skipped` and in a warning.
- **Metadata** is ``{"format": "pt"}``, as ``transformers`` and ``safetensors.torch.save_model`` write it.

Entry names become file names: characters other than letters, digits, ``.``, ``_`` and ``-`` turn into
``_``, leading dots are dropped; a name that is empty then, or two entries that meet in one file name
(case-insensitively), are refused. Each file is built in memory (``safetensors.torch.save``) and written
through the store, so any fsspec URL works as ``OUT_DIR``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable
from typing import Any

import torch

from checkpointd import commit
from checkpointd.errors import ConfigError, CorruptCheckpointError
from checkpointd.export.result import ExportedFile
from checkpointd.export.values import plain_values, step_values
from checkpointd.format import layout
from checkpointd.storage.store import Store

__all__ = ["SAFETENSORS_METADATA", "export_safetensors", "safetensors_file_names", "weights_of"]

logger = logging.getLogger("checkpointd")

SAFETENSORS_METADATA = {"format": "pt"}
_UNSAFE_CHARS = re.compile(r"[^A-Za-z0-9._-]")
_MAX_STEM_CHARS = 200


def safetensors_file_names(entries: Iterable[str]) -> dict[str, str]:
    """``{entry name: file name}``: ``"model"`` -> ``"model.safetensors"``, unsafe characters as ``_``.

    Raises:
        ConfigError: a name leaves nothing usable, or two names give one file name.
    """
    out: dict[str, str] = {}
    seen: dict[str, str] = {}
    for name in entries:
        stem = _UNSAFE_CHARS.sub("_", name).lstrip(".")[:_MAX_STEM_CHARS]
        if not stem.strip("_"):
            raise ConfigError(f"state entry {name!r} gives no usable file name; rename the entry in the state "
                              "passed to CheckpointManager, or export with --format dcp")
        file = f"{stem}.safetensors"
        other = seen.get(file.casefold())
        if other is not None:
            raise ConfigError(f"state entries {other!r} and {name!r} would both be written to {file}; rename one "
                              "of them, or export with --format dcp")
        seen[file.casefold()] = name
        out[name] = file
    return out


def weights_of(entry: str, state_dict: Any) -> tuple[dict[str, torch.Tensor], list[str]]:
    """``(tensors ready for safetensors, keys left out)`` of one module's state dict.

    Every tensor is contiguous and owns its storage where another key shares it (cloned, see the module
    docstring); values that are not tensors are left out.
    """
    if not isinstance(state_dict, dict):
        raise CorruptCheckpointError(f"state entry {entry!r} is a module entry but holds a {type(state_dict).__name__}, "
                                     "not a state dict")
    tensors: dict[str, torch.Tensor] = {}
    skipped = []
    for key, value in state_dict.items():
        if isinstance(value, torch.Tensor) and isinstance(key, str):
            tensors[key] = value.detach()
        else:
            skipped.append(str(key))
    users: dict[int, int] = {}
    for t in tensors.values():
        if t.numel():
            ptr = t.untyped_storage().data_ptr()
            users[ptr] = users.get(ptr, 0) + 1
    for key, t in tensors.items():
        shared = t.numel() and users[t.untyped_storage().data_ptr()] > 1
        tensors[key] = t.clone(memory_format=torch.contiguous_format) if shared else t.contiguous()
    return tensors, skipped


def export_safetensors(store: Store, step_dir: str, out: Store, *, overwrite: bool = False,
                       on_bytes: Callable[[int], None] | None = None, dequantize: bool = False) -> list[ExportedFile]:
    """Write each module entry of the committed step ``step_dir`` of ``store`` as ``out/<entry>.safetensors``.

    ``dequantize``: write tensor subclasses (quantized tensors) as plain dequantized tensors, not
    bit-exact; without it a step holding them is refused.

    Raises:
        ConfigError: the step has no module entry, holds tensor subclasses and ``dequantize`` is False, a target file exists and ``overwrite`` is False, an
            entry name gives no usable file name, a tensor has a dtype safetensors cannot store, or the
            safetensors package is not installed.
        IncompleteCheckpointError / ManifestError / CorruptCheckpointError / UnsafeCheckpointError: the
            step does not verify; nothing is written.
    """
    try:
        from safetensors.torch import save as safetensors_save
    except ImportError as exc:
        raise ConfigError("--format safetensors needs the safetensors package: pip install safetensors") from exc
    manifest = commit.read_committed_manifest(store, step_dir)
    modules = [name for name, loc in manifest.entries.items() if loc.kind == "module"]
    if not modules:
        raise ConfigError(f"step {manifest.step} at {store.display(step_dir)} holds no nn.Module entry (entries: "
                          f"{sorted(manifest.entries)}); safetensors holds model weights only: use --format dcp or native")
    files = safetensors_file_names(modules)
    if not overwrite:
        existing = [f for f in files.values() if out.exists(f)]
        if existing:
            raise ConfigError(f"{out.display(existing[0])} already exists; pass --overwrite or choose an empty OUT_DIR")
    values = plain_values(step_values(store, step_dir, manifest, modules, on_bytes=on_bytes), manifest,
                          "safetensors", dequantize)
    results: list[ExportedFile] = []
    written: list[str] = []
    try:
        for name in modules:
            data, skipped = _encode(name, files[name], values.pop(name), safetensors_save)
            results.append(ExportedFile(source=store.display(layout.join(step_dir, manifest.entries[name].file)),
                                        target=out.display(files[name]),
                                        stored_bytes=manifest.file(manifest.entries[name].file).size,
                                        native_bytes=len(data), skipped=skipped))
            written.append(files[name])
            out.write_bytes(files[name], data)
    except BaseException:
        for file in written:  # nothing half-exported is left
            try:
                out.remove(file)
            except OSError:
                pass
        raise
    return results


def _encode(entry: str, file: str, state_dict: Any, save: Callable[..., bytes]) -> tuple[bytes, list[str]]:
    """The safetensors bytes of one module's state dict, and the keys left out (with a warning)."""
    tensors, skipped = weights_of(entry, state_dict)
    if skipped:
        logger.warning("%s: left out %d value(s) of entry %r that are not tensors: %s", file, len(skipped), entry,
                       ", ".join(skipped[:10]) + (" ..." if len(skipped) > 10 else ""))
    try:
        return save(tensors, metadata=SAFETENSORS_METADATA), skipped
    except (ValueError, TypeError, RuntimeError) as exc:
        raise ConfigError(f"entry {entry!r} cannot be written as safetensors: {exc}") from exc
