"""``CheckpointdIO``: a Lightning ``CheckpointIO`` plugin that saves in the background with checkpointd.

::

    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from checkpointd.integrations.lightning import CheckpointdIO

    trainer = Trainer(plugins=[CheckpointdIO()],
                      callbacks=[ModelCheckpoint(dirpath="ckpt", save_last=True, every_n_train_steps=500)])
    trainer.fit(model, ckpt_path="last")        # resumes from the newest checkpoint, if any

How it works, and why:

- **One manager per plugin.** The first ``save_checkpoint`` opens one :class:`checkpointd.CheckpointManager`
  on the root ``<directory of that checkpoint>/.checkpointd`` (or ``root``), closed at ``teardown``:
  its staging buffers and background writer are reused by every save (building them per save would
  cost more than the save). Its one registered entry returns the dict of the current
  ``save_checkpoint`` call; each save is a new checkpointd step, a counter that never repeats in the root.
- **A save** snapshots the dict before ``save_checkpoint`` returns: Lightning's dict holds the live
  parameters (``state_dict()`` shares their memory) and the live optimizer state, so the values of
  the save step are copied into reused staging buffers first (on CUDA the call also waits for the
  device-to-host copies: the plugin sees a dict, not the optimizer whose next step it would otherwise
  hook). The writer then writes, verifies and commits the step in the background, marker last. The
  path Lightning asked for gets a small pointer file at once (``lightning_pointer``), so
  ``ModelCheckpoint``'s ``exists``/``last.ckpt``/link logic works unchanged.
- **Removal.** ``remove_checkpoint`` deletes the pointer at once and its step once nothing needs it:
  not while it is in flight, nor while a newer pointer would fall back to it because its own save has
  not committed. A pointer written over (``last.ckpt``) gives up its step the same way.
- **Loading.** ``load_checkpoint`` reads the pointer and returns the verified dict (``checkpointd.load``,
  weights-only); a pointer whose save never committed gives its fallback, the newest checkpoint that
  had committed before that save began, with a warning. A file that is not a pointer (a plain
  ``torch.save`` checkpoint) loads with Lightning's ``TorchCheckpointIO``, ``weights_only=True`` unless
  the caller passes ``weights_only=False`` for a file they trust.
- **Errors.** Bad state (an object in the dict that cannot be stored safely) raises ``StateError`` from
  ``save_checkpoint``. A background failure raises ``CheckpointWriteError`` from the next
  ``save_checkpoint``, or from ``teardown`` (the end of ``fit``), which waits for every save.
- **Processes.** Lightning calls ``save_checkpoint``/``remove_checkpoint`` on global rank 0 only, and a
  ``CheckpointManager`` under ``torch.distributed`` coordinates every rank; so saving is for
  single-process runs, and under a process group of several ranks the first save raises ``ConfigError``.
  Loading works on every rank.

``LightningModule.load_from_checkpoint`` reads files with ``torch.load`` itself, not through the plugin:
use :func:`load_checkpoint` here for a pointer, then ``model.load_state_dict(ckpt["state_dict"])``.
"""

from __future__ import annotations

import logging
import os
import uuid
import warnings
from typing import Any, Callable, Mapping

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from checkpointd import commit
from checkpointd.errors import (NOT_VERIFIED, CheckpointError, CheckpointNotFoundError, CheckpointWriteError, ConfigError,
                                CorruptCheckpointError, IncompleteCheckpointError)
from checkpointd.format import layout
from checkpointd.integrations.lightning_pointer import (SAVE_ID_METRIC, Pointer, SaveRef, dirname, is_link, join,
                                                        normalize, read_pointer, remove_file, resolve_root,
                                                        root_as_stored, write_pointer)
from checkpointd.load import load as load_step
from checkpointd.manager import CheckpointManager
from checkpointd.options import IOOptions, StagingOptions
from checkpointd.storage.store import Store

logger = logging.getLogger("checkpointd")

DEFAULT_ROOT_NAME = ".checkpointd"
"""The root's name beside the first checkpoint, when no ``root`` is given."""
ENTRY = "lightning"
"""The manager's one state entry: the Lightning checkpoint dict."""
_MANAGER_DEFAULT = object()


class _CurrentCheckpoint:
    """The manager's registered state: ``state_dict()`` is the dict of the ``save_checkpoint`` in progress."""

    def __init__(self) -> None:
        self.checkpoint: dict[str, Any] = {}

    def state_dict(self) -> dict[str, Any]:
        return self.checkpoint

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        raise ConfigError("CheckpointdIO's manager never restores in place; Lightning loads through load_checkpoint")


class CheckpointdIO(CheckpointIO):
    """Lightning ``CheckpointIO`` saving with checkpointd: background writes, atomic commit, verified loads.

    Args:
        root: the checkpointd root (local path or fsspec URL); default ``.checkpointd`` beside the
            first checkpoint saved.
        compression: passed to ``CheckpointManager`` (its default when not given).
        max_pending: saves in flight before ``save_checkpoint`` waits for the oldest. ``ModelCheckpoint``
            with ``save_top_k`` and ``save_last=True`` saves twice per checkpoint step: ``max_pending=2``
            (twice the staging memory) lets both write in the background; ``save_last="link"`` saves once.
        storage_options: fsspec options of the root (and of loads through pointers).
        staging: :class:`checkpointd.StagingOptions` for the manager.
        io: :class:`checkpointd.IOOptions` for the manager.
    """

    def __init__(self, root: str | os.PathLike[str] | None = None, *, compression: Any = _MANAGER_DEFAULT,
                 max_pending: int = 1, storage_options: dict[str, Any] | None = None,
                 staging: StagingOptions | None = None, io: IOOptions | None = None) -> None:
        super().__init__()
        if isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending < 1:
            raise ConfigError(f"CheckpointdIO(max_pending=...) must be an int >= 1, got {max_pending!r}")
        self._root_arg = None if root is None else normalize(root)
        self._storage_options = storage_options
        self._max_pending = max_pending
        self._manager_options: dict[str, Any] = {"max_pending": max_pending, "storage_options": storage_options}
        if compression is not _MANAGER_DEFAULT:
            self._manager_options["compression"] = compression
        if staging is not None:
            self._manager_options["staging"] = staging
        if io is not None:
            self._manager_options["io"] = io
        self._current = _CurrentCheckpoint()
        self._mgr: CheckpointManager | None = None
        self._store: Store | None = None
        self._root: str | None = None
        self._next_step = 1
        self._ids: dict[int, str | None] = {}
        """Save ids of steps in this root: this plugin's saves, and older ones once read from their manifests."""
        self._pending: list[int] = []
        """Steps saved by this plugin and not yet known to be committed."""
        self._alive: set[int] = set()
        """Committed steps of the root not deleted by this plugin."""
        self._doomed: set[int] = set()
        """Steps no pointer owns any more: deleted once nothing needs them."""
        self._guards: dict[int, int] = {}
        """pending step -> the step its pointer falls back to (kept while the pending one is in flight)."""
        self._failed = False

    @property
    def root(self) -> str | None:
        """The checkpointd root in use (None before the first save when ``root`` is None)."""
        return self._root or self._root_arg

    # -- saving --------------------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike[str],
                        storage_options: Any | None = None) -> None:
        """Snapshot ``checkpoint``, start its background write, and point ``path`` at it.

        Called on the training thread by ``Trainer.save_checkpoint`` (global rank 0). Returns once the
        values are copied (on CUDA: once the device-to-host copies are done); the write, checksums and
        commit happen on checkpointd's writer thread.

        Raises:
            ConfigError: ``storage_options`` given (pass them to ``CheckpointdIO``), or several processes.
            StateError: something in ``checkpoint`` cannot be stored safely (nothing is written).
            CheckpointWriteError: an earlier background save failed.
        """
        if storage_options is not None:
            raise ConfigError("CheckpointdIO.save_checkpoint takes no storage_options per save; pass "
                              "storage_options=... to CheckpointdIO(...) for its root")
        if not isinstance(checkpoint, dict):
            raise ConfigError(f"CheckpointdIO.save_checkpoint expects the checkpoint dict, got {type(checkpoint).__name__}")
        path = normalize(path)
        mgr = self._open(path)
        replaced = self._owned_ref(path)
        step = self._next_step
        save_id = uuid.uuid4().hex
        self._current.checkpoint = checkpoint
        try:
            mgr.save(step, metrics=_metrics(checkpoint, save_id, path))
        except CheckpointWriteError:
            self._failed = True
            raise
        finally:
            self._current.checkpoint = {}
        self._next_step = step + 1
        self._settle(step - self._max_pending)  # maybe_save returned: the saves before these are committed
        fallback = self._newest_alive()  # after the settling: the newest checkpoint committed by now
        self._pending.append(step)
        self._ids[step] = save_id
        if torch.cuda.is_available():
            mgr.wait_for_snapshot()  # the plugin cannot hook Lightning's next optimizer step
        assert self._root is not None
        write_pointer(path, Pointer(root=root_as_stored(path, self._root), target=SaveRef(step, save_id),
                                    fallback=fallback, global_step=_count(checkpoint.get("global_step"))))
        if fallback is not None:
            self._guards[step] = fallback.step
        if replaced is not None:
            self._doomed.add(replaced.step)
        self._sweep()

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Delete the file at ``path`` now, and the step it owns once nothing needs it (see the module doc)."""
        path = normalize(path)
        if is_link(path):  # a link (save_last="link") owns nothing: its target's pointer does
            remove_file(path)
            return
        try:
            owned = self._owned_ref(path)
        except CheckpointError as exc:  # unreadable: removed all the same, its step left to `checkpointd gc`
            logger.warning("checkpointd: removing %s, which does not read as a checkpointd pointer: %s", path, exc)
            owned = None
        remove_file(path)
        if owned is not None:
            self._doomed.add(owned.step)
            self._sweep()

    def wait(self, timeout: float | None = None) -> None:
        """Wait for every started save to commit, then delete the steps that nothing needs.

        Raises:
            CheckpointWriteError: a background save failed.
            CheckpointTimeoutError: ``timeout`` seconds passed first.
        """
        if self._mgr is None:
            return
        try:
            self._mgr.wait(timeout)
        except CheckpointWriteError:
            self._failed = True
            raise
        self._settle(self._next_step)
        self._sweep()

    def stats(self) -> dict[str, Any]:
        """The manager's ``stats()`` (per-phase seconds of the last save, bytes, ...); {} when none is open."""
        return self._mgr.stats() if self._mgr is not None else {}

    def teardown(self) -> None:
        """Wait for every save, delete what nothing needs, then close the manager (end of ``fit``).

        Raises:
            CheckpointWriteError: a background save failed, unless ``save_checkpoint`` raised it already
                (Lightning is then propagating that error, which this call does not mask).
        """
        mgr = self._mgr
        if mgr is None:
            return
        already_raised = self._failed
        error: CheckpointError | None = None
        try:
            self.wait()
        except CheckpointError as exc:
            error = exc
        finally:
            self._mgr = None
            try:
                mgr.close()
            except CheckpointError as exc:
                error = error or exc
        self._failed = False
        if error is not None:
            if already_raised:
                logger.error("checkpointd: a checkpoint save failed: %s", error)
                return
            raise error

    # -- loading -------------------------------------------------------------------------------------
    def load_checkpoint(self, path: str | os.PathLike[str], map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint dict at ``path``: through its pointer (verified), or a plain ``torch.save`` file.

        Args:
            path: a file ``save_checkpoint`` wrote (or a link to one), or a ``torch.save`` checkpoint.
            map_location: None (CPU tensors; Lightning copies them into the live objects), a device or a
                device string. For a ``torch.save`` file, anything ``torch.load`` takes.
            weights_only: only for a ``torch.save`` file: None or True load with torch's weights-only
                unpickler; False unpickles arbitrary objects (only for files you trust).

        Raises:
            CheckpointNotFoundError: nothing at ``path`` (also a FileNotFoundError).
            IncompleteCheckpointError: its save never committed and no earlier checkpoint had.
        """
        path = normalize(path)
        pointer = read_pointer(path)
        if pointer is None:
            kwargs: dict[str, Any] = {} if map_location is None else {"map_location": map_location}
            return TorchCheckpointIO().load_checkpoint(path, weights_only=True if weights_only is None else weights_only,
                                                       **kwargs)
        if self._mgr is not None:
            self.wait()  # a save of this process may be what the pointer names
        return _to_location(_load_pointed(path, pointer, self._storage_options), map_location)

    # -- the manager and the steps it owns ----------------------------------------------------------
    def _open(self, path: str) -> CheckpointManager:
        if self._mgr is not None:
            return self._mgr
        _refuse_several_processes()
        root = self._root_arg or join(dirname(path), DEFAULT_ROOT_NAME)
        mgr = CheckpointManager(root, {ENTRY: self._current}, keep_last=None, **self._manager_options)
        store = Store(root, self._storage_options)
        self._mgr, self._store, self._root = mgr, store, root
        self._next_step = max(self._next_step, max(commit.list_step_dirs(store), default=0) + 1)
        self._alive = set(mgr.steps())
        self._pending = []
        return mgr

    def _owned_ref(self, path: str) -> SaveRef | None:
        """The save the pointer file at ``path`` owns, when it is a step of this plugin's root."""
        if is_link(path):
            return None
        try:
            pointer = read_pointer(path)
        except CheckpointNotFoundError:
            return None
        root = self.root
        if pointer is None or root is None or resolve_root(path, pointer.root) != root:
            return None
        if self._save_id(pointer.target.step) != pointer.target.save_id:
            return None  # a save that never committed, its number since taken by another
        return pointer.target

    def _save_id(self, step: int) -> str | None:
        if step not in self._ids and self._store is not None and step in self._alive:
            try:
                manifest = commit.read_committed_manifest(self._store, layout.step_dir_name(step))
                value = manifest.metrics.get(SAVE_ID_METRIC)
                self._ids[step] = value if isinstance(value, str) else None
            except CheckpointError:
                self._ids[step] = None
        return self._ids.get(step)

    def _newest_alive(self) -> SaveRef | None:
        """The newest committed step, as the fallback of the save about to start."""
        for step in sorted(self._alive, reverse=True):
            save_id = self._save_id(step)
            if save_id is not None:
                return SaveRef(step, save_id)
        return None

    def _settle(self, upto: int) -> None:
        """Saves of steps up to ``upto`` are committed (``maybe_save``/``wait`` returned without error)."""
        done = [s for s in self._pending if s <= upto]
        self._pending = [s for s in self._pending if s > upto]
        self._alive.update(done)

    def _sweep(self) -> None:
        """Delete the doomed steps nothing needs: not in flight, and no pending save falls back to them.
        Only while the manager is open: it holds the root's lease."""
        if self._mgr is None:
            return
        self._guards = {s: f for s, f in self._guards.items() if s in self._pending}
        needed = set(self._pending) | set(self._guards.values())
        for step in sorted(self._doomed - needed):
            self._doomed.discard(step)
            self._delete(step)

    def _delete(self, step: int) -> None:
        assert self._store is not None
        try:
            commit.uncommit_and_remove(self._store, layout.step_dir_name(step))
        except (OSError, CheckpointError) as exc:  # the marker goes first: what is left is a leftover
            logger.warning("checkpointd: cannot remove step %d under %s: %s (`checkpointd gc` removes leftovers)",
                           step, self._store.display(), exc)
        self._alive.discard(step)
        self._ids.pop(step, None)


def load_checkpoint(path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The Lightning checkpoint dict that the pointer file at ``path`` names, verified, with CPU tensors.

    For use outside a ``Trainer`` (``LightningModule.load_from_checkpoint`` reads files with
    ``torch.load`` and cannot read a pointer).

    Raises:
        CheckpointNotFoundError: nothing at ``path``.
        ConfigError: ``path`` is not a pointer written by ``CheckpointdIO`` (load it with ``torch.load``).
        IncompleteCheckpointError: its save never committed and no earlier checkpoint had.
    """
    path = normalize(path)
    pointer = read_pointer(path)
    if pointer is None:
        raise ConfigError(f"{path} is not a checkpointd pointer written by CheckpointdIO; load it with "
                          "torch.load(path, weights_only=True)")
    return _load_pointed(path, pointer, storage_options)


def _load_pointed(path: str, pointer: Pointer, storage_options: dict[str, Any] | None) -> dict[str, Any]:
    """The checkpoint ``pointer`` (read from ``path``) names: its target, else its fallback with a warning."""
    root = resolve_root(path, pointer.root)
    try:
        return _load_save(root, pointer.target, storage_options)
    except (CheckpointNotFoundError, *NOT_VERIFIED) as exc:
        if pointer.fallback is None:
            raise IncompleteCheckpointError(
                f"{path} names step {pointer.target.step} under {root}, which is not a complete checkpoint ({exc}): its "
                "save did not finish (the process died during it?) and no earlier checkpoint had committed. Delete "
                f"{path} to start from scratch, or load another checkpoint") from exc
        warnings.warn(f"checkpointd: {path} names step {pointer.target.step}, which is not a complete checkpoint "
                      f"({exc}); loading step {pointer.fallback.step}, the newest checkpoint committed before that "
                      "save began", RuntimeWarning, stacklevel=3)
        try:
            return _load_save(root, pointer.fallback, storage_options)
        except (CheckpointNotFoundError, *NOT_VERIFIED) as exc2:
            raise IncompleteCheckpointError(
                f"{path} names step {pointer.target.step} under {root}, which is not a complete checkpoint ({exc}), "
                f"and its fallback step {pointer.fallback.step} cannot be loaded either ({exc2}); load another "
                "checkpoint") from exc2


def _load_save(root: str, ref: SaveRef, storage_options: dict[str, Any] | None) -> dict[str, Any]:
    step_dir = join(root, layout.step_dir_name(ref.step))
    manifest = commit.read_committed_manifest(Store(step_dir, storage_options), "")
    if manifest.metrics.get(SAVE_ID_METRIC) != ref.save_id:
        raise IncompleteCheckpointError(f"{step_dir} holds save {manifest.metrics.get(SAVE_ID_METRIC)!r}, not "
                                        f"{ref.save_id!r}: the save the pointer names never committed")
    value = load_step(step_dir, storage_options=storage_options).get(ENTRY)
    if not isinstance(value, dict):
        raise CorruptCheckpointError(f"{step_dir} holds no Lightning checkpoint (entry {ENTRY!r})")
    return value


def _metrics(checkpoint: Mapping[str, Any], save_id: str, path: str) -> dict[str, Any]:
    out: dict[str, Any] = {SAVE_ID_METRIC: save_id, "lightning_file": path.rstrip("/").rsplit("/", 1)[-1]}
    for key in ("global_step", "epoch"):
        if _count(checkpoint.get(key)) is not None:
            out[f"lightning_{key}"] = checkpoint[key]
    return out


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _refuse_several_processes() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        raise ConfigError(
            f"CheckpointdIO saves from one process, and this run has {torch.distributed.get_world_size()} ranks: "
            "Lightning calls save_checkpoint on rank 0 alone, while a CheckpointManager under torch.distributed "
            "coordinates every rank. Use checkpointd.CheckpointManager in a callback that runs on every rank, "
            "or Lightning's own checkpoint IO for this run")


def _to_location(tree: Any, map_location: Any) -> Any:
    if map_location is None:
        return tree
    if isinstance(map_location, dict) or callable(map_location):
        raise ConfigError("CheckpointdIO.load_checkpoint takes map_location=None, a torch.device or a device string "
                          f"for checkpointd checkpoints, got {type(map_location).__name__}")
    device = torch.device(map_location)
    return _map_tensors(tree, lambda t: t.to(device))


def _map_tensors(tree: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, dict):
        return type(tree)((k, _map_tensors(v, fn)) for k, v in tree.items())
    if isinstance(tree, list):
        return [_map_tensors(v, fn) for v in tree]
    if isinstance(tree, tuple) and type(tree) is tuple:
        return tuple(_map_tensors(v, fn) for v in tree)
    return tree


__all__ = ["DEFAULT_ROOT_NAME", "ENTRY", "CheckpointdIO", "load_checkpoint"]
