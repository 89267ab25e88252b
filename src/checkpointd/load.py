"""``checkpointd.load``: one checkpoint as plain Python data, without a manager or live objects.

Accepts a checkpoint root, a step directory, a single ``.pt``/``.mdlus`` file (optionally compressed),
a directory written by PhysicsNeMo's ``save_checkpoint``, or a PyTorch Distributed Checkpoint (DCP)
directory (``torch.distributed.checkpoint.save``, TorchTitan; also a folder of TorchTitan's ``step-N``
DCP directories). Everything is verified and loaded with the weights-only unpickler (DCP's ``.metadata``
with the allow-list unpickler of :mod:`checkpointd.format.dcp`); tensors come back on the CPU.
"""

from __future__ import annotations

import os
import re
import warnings
from typing import Any

from checkpointd import commit
from checkpointd.format import dcp, layout
from checkpointd.format.dequantize import dequantize_tree, not_exact_warning
from checkpointd.format.subclasses import check_described, check_loaded, check_sharded_described
from checkpointd.errors import CheckpointNotFoundError, CorruptCheckpointError, IncompleteCheckpointError
from checkpointd.restore.assemble import assemble_full_values
from checkpointd.restore.step import decode, load_native, malformed_is_damage, read_step, values_by_entry
from checkpointd.storage.store import Store

_PN_FILE_RE = re.compile(r"^(?P<stem>.+)\.(?P<rank>\d+)\.(?P<epoch>\d+)\.(?P<ext>pt|mdlus)$")
_DCP_STEP_RE = re.compile(r"^step-(?P<step>[0-9]{1,18})$")
"""TorchTitan's checkpoint folders: ``step-10``, one DCP directory each."""


def load(path: str | os.PathLike[str], step: int | None = None, storage_options: dict[str, Any] | None = None, *,
         dequantize: bool = False) -> dict[str, Any]:
    """Load one checkpoint as ``{state name: stored value}`` with CPU tensors.

    Args:
        path: a root (latest committed step, or ``step``), a step directory, a single file, a
            PhysicsNeMo checkpoint directory (its newest epoch, or ``step``), a DCP directory, or a
            folder of ``step-N`` DCP directories (the newest, or ``step``).
        step: which step to load from a root, a PhysicsNeMo directory or a folder of DCP directories.
        storage_options: passed to fsspec.
        dequantize: give every tensor subclass (torchao's quantized tensors) as a plain tensor computed
            by its class (:mod:`checkpointd.format.dequantize`), with a warning: those values are not
            bit-exact. By default the subclass objects come back as stored (their classes must be
            imported and accepted, see ``checkpointd.allow_tensor_subclasses``).

    Raises:
        CheckpointNotFoundError: nothing loadable at ``path`` (or no such step).
        CorruptCheckpointError / IncompleteCheckpointError: the checkpoint does not verify.
        UnsafeCheckpointError: a file references code outside the allow-lists, or a tensor subclass this
            process has not imported or does not accept; nothing of it was run.
        ManifestError: a manifest or DCP ``.metadata`` is malformed.

    A DCP directory comes back as DCP's own loader rebuilds it: nested dicts keyed as DCP flattened
    them, so integer keys (an optimizer's ``state``) are strings; tensors whole and contiguous.
    """
    store = Store(path, storage_options)
    values = _load(store, step, dequantize)
    check_loaded(values, store.display())
    if not dequantize:
        return values
    done: dict[str, str] = {}
    values = dequantize_tree(values, (), done)
    if done:
        warnings.warn(not_exact_warning(done, "load(dequantize=True)"), UserWarning, stacklevel=2)
    return values


def _load(store: Store, step: int | None, dequantize: bool = False) -> Any:
    if store.is_file(""):
        return _load_single_file(store)
    names = store.list_dir("")
    if not names:
        raise CheckpointNotFoundError(f"{store.display()} does not exist or is empty")
    if layout.MANIFEST_NAME in names or layout.COMMIT_MARKER_NAME in names:
        if step is not None and layout.parse_step_dir_name(store.root) not in (None, step):
            raise CheckpointNotFoundError(f"{store.display()} is step {layout.parse_step_dir_name(store.root)}, not {step}")
        return _load_step_dir(store, "", dequantize)
    if dcp.is_dcp_dir(names):
        _check_dcp_step(store, step)
        return dcp.load_dcp(store)
    steps = commit.committed_steps(store)
    if steps:
        chosen = steps[-1] if step is None else step
        if chosen not in steps:
            raise CheckpointNotFoundError(f"step {step} is not committed under {store.display()} (committed: {steps[-10:]})")
        return _load_step_dir(store, layout.step_dir_name(chosen), dequantize)
    if any(layout.parse_step_dir_name(n) is not None for n in names):
        raise IncompleteCheckpointError(f"{store.display()} holds step directories but none is committed")
    dcp_steps = sorted(int(m.group("step")) for m in map(_DCP_STEP_RE.match, names) if m)
    if dcp_steps and not any(_PN_FILE_RE.match(n) for n in names):
        return _load_dcp_steps(store, dcp_steps, step)
    return _load_physicsnemo_dir(store, names, step)


def _load_step_dir(store: Store, step_dir: str, dequantize: bool = False) -> dict[str, Any]:
    manifest = commit.read_committed_manifest(store, step_dir)
    check_described(manifest.extra.get("subclasses"), store.display(step_dir))  # before any pickle runs
    check_sharded_described(manifest.extra.get("sharded"), store.display(step_dir))
    with malformed_is_damage(store.display(step_dir)):
        contents = read_step(store, step_dir, manifest, rank=None if manifest.mode == "sharded" else 0)
        if manifest.mode == "sharded":  # sharded checkpoints: merge the shards
            return assemble_full_values(manifest, contents, dequantize)
        return values_by_entry(manifest, contents)


def _check_dcp_step(store: Store, step: int | None) -> None:
    """A DCP directory holds one checkpoint: ``step`` may only name the step its ``step-N`` name says."""
    match = _DCP_STEP_RE.match(store.root.rsplit("/", 1)[-1])
    if step is not None and (match is None or int(match.group("step")) != step):
        raise CheckpointNotFoundError(f"{store.display()} is one DCP checkpoint"
                                      + (f" (step {match.group('step')})" if match else "") + f", not step {step}")


def _load_dcp_steps(store: Store, steps: list[int], step: int | None) -> dict[str, Any]:
    """TorchTitan's layout: ``step-N`` DCP directories; the newest one that has a ``.metadata``, or ``step``."""
    wanted = [s for s in reversed(steps) if step is None or s == step]
    for s in wanted:
        if store.is_link(f"step-{s}"):  # a link planted in a local folder is not followed
            continue
        sub = Store(layout.join(store.url, f"step-{s}"), fs=store.fs, retry=store.retry)
        if sub.exists(dcp.METADATA_NAME):
            return dcp.load_dcp(sub)
    if step is not None:
        raise CheckpointNotFoundError(f"{store.display()} has no DCP directory step-{step} with a {dcp.METADATA_NAME} "
                                      f"(steps: {steps[-10:]})")
    raise CheckpointNotFoundError(f"{store.display()} holds step-N directories but none has a DCP {dcp.METADATA_NAME}")


def _load_single_file(store: Store) -> Any:
    name = store.root.rsplit("/", 1)[-1]
    data = store.read_bytes("")
    codec = "none"
    if name.endswith(layout.ZSTD_SUFFIX):
        name = name[: -len(layout.ZSTD_SUFFIX)]
        codec = "zstd"
    fmt = "mdlus" if name.endswith(".mdlus") else "pt"
    return load_native(decode(codec, data, store.display()), fmt, store.display())


def _load_physicsnemo_dir(store: Store, names: list[str], step: int | None) -> dict[str, Any]:
    """PhysicsNeMo layout: pick ONE epoch for every file (PhysicsNeMo itself picks per file)."""
    by_epoch: dict[int, list[tuple[str, str, str]]] = {}
    for n in names:
        m = _PN_FILE_RE.match(n)
        if m:
            by_epoch.setdefault(int(m.group("epoch")), []).append((n, m.group("stem"), m.group("ext")))
    if not by_epoch:
        raise CheckpointNotFoundError(
            f"{store.display()} holds no checkpointd step directory and no PhysicsNeMo checkpoint files "
            "({Name}.{rank}.{epoch}.pt|mdlus)"
        )
    epoch = max(by_epoch) if step is None else step
    if epoch not in by_epoch:
        raise CheckpointNotFoundError(f"{store.display()} has no files for epoch {step} (epochs: {sorted(by_epoch)[-10:]})")
    out: dict[str, Any] = {}
    for fname, stem, ext in sorted(by_epoch[epoch]):
        content = load_native(store.read_bytes(fname), ext, store.display(fname))
        if stem == layout.TRAINING_STATE_STEM and isinstance(content, dict):
            out.update(content)
        else:
            out[stem] = content
    if not out:
        raise CorruptCheckpointError(f"{store.display()}: epoch {epoch} files are empty")
    return out
