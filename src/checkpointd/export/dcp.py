"""``checkpointd export --format dcp``: a committed step as a ``torch.distributed.checkpoint`` directory.

The step's whole values (what ``checkpointd.load`` returns: ``{"model": {...}, "optimizer": {...}, ...}``,
sharded steps assembled from every rank's file) are written by PyTorch's own
``torch.distributed.checkpoint.save(..., no_dist=True)`` with a ``FileSystemWriter``: one ``__0_0.distcp``
and the ``.metadata`` DCP writes last. The keys are the checkpoint's state names, so a training script
loads it in place::

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    get_optimizer_state_dict(model, optim)   # creates the optimizer's state (a step with zero grads)
    target = {"model": model.state_dict(), "optimizer": optim.state_dict()}
    dcp.load(target, checkpoint_id=out_dir)
    model.load_state_dict(target["model"])
    optim.load_state_dict(target["optimizer"])

The optimizer needs state before ``dcp.load``: DCP fills only keys the target already has, and a new
optimizer has none. A full-mode step keys optimizer state by parameter index (``optim.state_dict()``),
a sharded-mode step by parameter name (the target is then ``get_optimizer_state_dict(model, optim)``,
applied with ``set_optimizer_state_dict``). DCP flattens nested keys as strings (``optimizer.state.0.exp_avg``)
and stores every non-tensor value (learning rates, ``betas``, ``params`` lists) as a ``torch.save`` blob
that ``dcp.load`` sets into the target; ``checkpointd.load`` reads the directory too, without running code.

Output: a local directory is written in place. Any other fsspec URL is written to a local temporary
directory first and then uploaded through the store (with its retries), ``.metadata`` last, so a reader
never sees a half-uploaded checkpoint as complete. ``OUT_DIR`` must be empty unless ``overwrite`` is
set; then the DCP files already there (``.metadata``, ``*.distcp``) are removed first and other files kept.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from collections.abc import Callable
from typing import Any

from checkpointd import commit
from checkpointd.errors import ConfigError
from checkpointd.export.result import ExportedFile
from checkpointd.export.values import plain_values, step_values
from checkpointd.format.dcp import DATA_SUFFIX, METADATA_NAME
from checkpointd.storage.store import Store

__all__ = ["export_dcp", "is_dcp_file"]

COPY_BLOCK_BYTES = 8 << 20


def is_dcp_file(name: str) -> bool:
    """The names a DCP export writes (and an ``overwrite`` removes): ``.metadata[.tmp]`` and ``*.distcp``."""
    return name in (METADATA_NAME, f"{METADATA_NAME}.tmp") or name.endswith(DATA_SUFFIX)


def export_dcp(store: Store, step_dir: str, out: Store, *, overwrite: bool = False,
               on_bytes: Callable[[int], None] | None = None, dequantize: bool = False) -> list[ExportedFile]:
    """Write the committed step ``step_dir`` of ``store`` as a DCP checkpoint directory ``out``.

    Args:
        overwrite: allow a non-empty ``out``; its DCP files are removed before anything is written.
        on_bytes: called with each checkpoint file's stored size once it is read (progress).
        dequantize: write tensor subclasses (quantized tensors) as plain dequantized tensors, not
            bit-exact (:func:`~checkpointd.export.values.plain_values`); without it such a step is refused.

    Returns:
        The files written, ``.metadata`` last.

    Raises:
        IncompleteCheckpointError / ManifestError / CorruptCheckpointError / UnsafeCheckpointError: the
            step does not verify; nothing is written.
        ConfigError: ``out`` is not empty and ``overwrite`` is False, or the values cannot be flattened
            into DCP keys (two keys that join to the same dotted name).
    """
    manifest = commit.read_committed_manifest(store, step_dir)
    present = out.list_dir("")
    if present and not overwrite:
        raise ConfigError(f"OUT_DIR {out.display()} is not empty ({len(present)} entries, e.g. {sorted(present)[0]!r}); "
                          "pass --overwrite (overwrite=True) or choose an empty OUT_DIR")
    values = plain_values(step_values(store, step_dir, manifest, on_bytes=on_bytes), manifest, "dcp", dequantize)
    for name in sorted(n for n in present if is_dcp_file(n)):
        out.remove(name)
    if out.is_local:
        out.makedirs("")
        names = _save(values, out.root, lambda: [n for n in out.list_dir("") if is_dcp_file(n)], out.remove)
    else:
        with tempfile.TemporaryDirectory(prefix="checkpointd-dcp-") as staging:
            names = _save(values, staging, lambda: os.listdir(staging), lambda n: None)
            _upload(staging, names, out)
    where = store.display(step_dir)
    return [ExportedFile(source=where, target=out.display(n), stored_bytes=0, native_bytes=out.size(n)) for n in names]


def _save(values: dict[str, Any], directory: str, listing: Callable[[], list[str]], remove: Callable[[str], None]) -> list[str]:
    """``dcp.save`` of ``values`` into the local ``directory``; the DCP files written, ``.metadata`` last.

    On failure the DCP files in ``directory`` are removed again (``overwrite`` removed older ones first).
    """
    import torch.distributed.checkpoint as dcp  # ~1.5 s to import: only when a DCP export runs

    writer = dcp.FileSystemWriter(directory, single_file_per_rank=True, sync_files=True, thread_count=1)
    try:
        with warnings.catch_warnings():  # no_dist=True is the intent; DCP warns about it anyway
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(values, storage_writer=writer, no_dist=True)
    except BaseException as exc:
        for name in listing():
            remove(name)
        if isinstance(exc, ValueError) and "flatten" in str(exc):
            raise ConfigError(f"the step's values cannot be written as DCP keys: {exc}; DCP joins nested keys with "
                              "'.', so two keys that join to the same name cannot both be exported") from exc
        raise
    data = sorted(n for n in listing() if n.endswith(DATA_SUFFIX))
    return [*data, METADATA_NAME]


def _upload(staging: str, names: list[str], out: Store) -> None:
    """Copy the staged files into ``out`` in order (``.metadata`` is last); on failure remove what was copied."""
    copied: list[str] = []
    try:
        for name in names:
            copied.append(name)
            with open(os.path.join(staging, name), "rb") as src, out.open_write(name) as dst:
                shutil.copyfileobj(src, dst, COPY_BLOCK_BYTES)
    except BaseException:
        for name in reversed(copied):
            try:
                out.remove(name)
            except OSError:
                pass
        raise
