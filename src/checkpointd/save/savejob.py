"""From validated file trees to a background job: collect tensors, snapshot them, plan the files.

This is the seam between the training thread and the committer thread. On the training thread,
:func:`stage_save` walks each file's tree, replaces every tensor by a slot (deduplicating tensors that
appear twice, e.g. tied weights), and hands the tensors to the snapshot stage. The job it returns
carries a ``before_write`` callback that runs on the committer thread: it waits for the copies, fills
the slots with the staged buffers and pickles each file (``serialize.plan_pt``).

Under a host staging budget the staged "buffers" of device tensors are meta placeholders: pickling
needs only their layout. ``before_write`` then lays out the chunk stream in each file's record order
(``ChunkStream.plan``) and gives every file its reader; the writer streams the bytes (``writer.py``).
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from typing import Any, Callable, Sequence

import torch

from checkpointd.version import VERSION
from checkpointd.format import layout
from checkpointd.format.manifest import EntryLocation, Manifest
from checkpointd.format.serialize import ReductionCache, plan_pt
from checkpointd.save.chunkstream import ChunkStream
from checkpointd.save.snapshot import StagedTensors, Snapshotter, TensorSpec, tensor_spec
from checkpointd.state import DeferredScalar, Entry, FileContent, copy_tree
from checkpointd.save.writer import PARALLEL_WRITE_ENV, FileJob, SaveJob

logger = logging.getLogger("checkpointd")

ENQUEUE_GRACE_SECS = 2.0
"""How long the writer lets the training thread's hooks queue a snapshot's copies before queueing them itself."""


REDUCTIONS = ReductionCache()
"""Pickle reductions of the staging buffers, reused by every later save of the same buffers (weakly held)."""


def prewarm_reductions(arena: Any) -> None:
    """Pickle an arena's buffers once, on the thread that prepared it ahead, to fill :data:`REDUCTIONS`.

    Why: the first save's pickling otherwise builds every buffer's reduction (~20 us a tensor) on the
    committer thread during the steps right after the save point, holding the GIL that a launch-bound
    training loop needs (a 0.45 GB state's first checkpoint cost 32-34 ms against ~12 for the later
    ones on an H100 host; on the GPU hosts measured since, their noise hid the effect). The buffers are
    the very tensors the saves pickle, so the entries hit.
    """
    buffers = [b for b in arena.buffers if b.numel()]
    if not buffers:
        return
    try:
        plan_pt(buffers, cache=REDUCTIONS)
    except Exception as exc:  # noqa: BLE001 - only a warm-up: the save pickles them itself
        logger.debug("checkpointd: could not pre-pickle the staging buffers: %s", exc)


class _Slot:
    """Placeholder for the i-th staged tensor inside a tree skeleton."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


def collect_tensors(trees: Sequence[Any]) -> tuple[list[Any], list[torch.Tensor]]:
    """Skeletons of ``trees`` (tensors replaced by slots) and the distinct tensors, in walk order.

    Two entries are one tensor (stored once, e.g. tied weights) when they are the same view of the same
    memory. Most tensors start at an address no other one does, so the full view key is built only for
    those that share one: this runs on the training thread for every tensor of every save.
    """
    tensors: list[torch.Tensor] = []
    at_address: dict[int, list[int]] = {}

    def collect(t: torch.Tensor) -> _Slot:
        ptr = t.data_ptr()
        same_start = at_address.get(ptr) if ptr else None  # empty tensors share data_ptr 0: never merge them
        if same_start is not None:
            key = _view_key(t)
            for j in same_start:
                if _view_key(tensors[j]) == key:
                    return _Slot(j)
            same_start.append(len(tensors))
        elif ptr:
            at_address[ptr] = [len(tensors)]
        tensors.append(t)
        return _Slot(len(tensors) - 1)

    return [copy_tree(tree, collect) for tree in trees], tensors


def _view_key(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.device, t.data_ptr(), t.dtype, t.shape, t.stride(), t.storage_offset())


def buffers_first(entries: Sequence[Entry], tensors: Sequence[torch.Tensor]) -> tuple[list[int], int]:
    """Order of ``tensors`` with the registered modules' buffers first, and how many those are.

    The next forward pass (which updates e.g. BatchNorm statistics) waits only for that first group
    (CUDA buffers; CPU ones are copied in ``maybe_save``, except in the host-budget CPU test mode).
    """
    ptrs: set[tuple[str, int]] = set()
    for e in entries:
        if e.kind == "module":
            ptrs.update((b.device.type, b.data_ptr()) for b in e.obj.buffers() if b.numel())
    if not ptrs:
        return list(range(len(tensors))), 0
    first = [i for i, t in enumerate(tensors) if t.numel() and (t.device.type, t.data_ptr()) in ptrs]
    chosen = set(first)
    return first + [i for i in range(len(tensors)) if i not in chosen], len(first)


def staging_layout(entries: Sequence[Entry], files: Sequence[FileContent]) -> tuple[list[TensorSpec], torch.device | None, list[bool]]:
    """``(specs, cuda_device, cuda_mask)``: what :meth:`Snapshotter.prepare_async` needs to allocate
    buffers ahead of the first save, in the order the save will stage them."""
    _, tensors = collect_tensors([f.tree for f in files])
    order, _ = buffers_first(entries, tensors)
    ordered = [tensors[i] for i in order]
    cuda_device = next((t.device for t in ordered if t.device.type == "cuda"), None)
    return [tensor_spec(t) for t in ordered], cuda_device, [t.device.type == "cuda" for t in ordered]


def files_ahead(store: Any, codec: Any, files: Sequence[FileContent], busy: Callable[[], bool] | None = None,
                saves_started: Callable[[], int] | None = None) -> Any:
    """Blank files for the first saves of ``files`` (:class:`checkpointd.storage.recycle.FilesAhead`), started
    (made once ``busy()`` is False); None where saves would not take them (no recycling, a codec,
    streaming writes) or they are turned off."""
    from checkpointd.storage import persist_process
    from checkpointd.storage import recycle

    sets = recycle.FilesAhead.sets_wanted()
    if (sets == 0 or not recycle.enabled(store) or getattr(codec, "name", None) != "none"
            or os.environ.get(PARALLEL_WRITE_ENV, "1") == "0"):
        return None
    ahead = recycle.FilesAhead(store, blank_file_sizes(files), sets, premap=persist_process.keep_blank_file, busy=busy,
                               saves_started=saves_started)
    ahead.start()
    return ahead


def blank_file_sizes(files: Sequence[FileContent]) -> list[int]:
    """The sizes of blank files that one save of ``files`` would take (:func:`checkpointd.storage.recycle.sizes_ahead`)."""
    from checkpointd.storage import recycle

    tensor_bytes = []
    for f in files:
        _, tensors = collect_tensors([f.tree])
        tensor_bytes.append(sum(t.numel() * t.element_size() for t in tensors))
    return recycle.sizes_ahead(tensor_bytes)


def saved_class_name(e: Entry) -> str | None:
    """The class recorded for an entry: a module's (PhysicsNeMo naming), an optimizer's or other stateful
    object's (a restore refuses another class: Adam's state in an SGD optimizer breaks its next step)."""
    if e.kind == "module":
        return e.class_name
    return type(e.obj).__name__ if e.kind in ("optimizer", "scheduler", "scaler", "stateful") else None


def entry_locations(entries: Sequence[Entry], files: Sequence[FileContent]) -> dict[str, EntryLocation]:
    """The manifest's map from each registered name to its file and key."""
    by_name = {e.name: e for e in entries}
    out: dict[str, EntryLocation] = {}
    for f in files:
        for name in f.entry_names:
            e = by_name[name]
            out[name] = EntryLocation(kind=e.kind, file=f.rel_path, key=e.key, class_name=saved_class_name(e))
    return out


def stage_save(
    *,
    step: int,
    files: list[FileContent],
    entries: Sequence[Entry],
    snapshotter: Snapshotter,
    metrics: dict[str, Any],
    mode: str,
    world_size: int,
    codec_name: str,
    locations: dict[str, EntryLocation] | None,
    extra: dict[str, Any],
    clear_step_dir: Callable[[str], None],
) -> SaveJob:
    """Snapshot every tensor of ``files`` (training thread) and return the job that writes them.

    Args:
        clear_step_dir: called on the committer thread before any file is written (removes an
            uncommitted leftover of the same step).
    """
    skeletons, tensors = collect_tensors([f.tree for f in files])
    order, n_buffers = buffers_first(entries, tensors)
    staged_in_order = snapshotter.snapshot([tensors[i] for i in order], n_buffer_tensors=n_buffers)
    staged: list[torch.Tensor] = [None] * len(tensors)  # type: ignore[list-item]
    for pos, i in enumerate(order):
        staged[i] = staged_in_order.staged[pos]
    step_dir = layout.step_dir_name(step)
    manifest = Manifest(step=step, time=time.time(), world_size=world_size, mode=mode, codec=codec_name,
                        library_version=VERSION, torch_version=torch.__version__, metrics=metrics,
                        entries=entry_locations(entries, files) if locations is None else locations,
                        extra=extra)
    job = SaveJob(step=step, step_dir=step_dir, files=[], manifest=manifest,
                  before_write=lambda: None, after_files=lambda: snapshotter.release(staged_in_order))

    if isinstance(staged_in_order.copies, ChunkStream):
        job.before_write = lambda: _before_streamed_write(job, files, skeletons, staged, order, staged_in_order,
                                                          step_dir, clear_step_dir)
        return job

    planned: list[FileJob] = []  # files pickled so far, in order (kept when planning ahead stops early)

    def plan_files(copied: bool = True) -> None:  # committer thread
        """Pickle every file; ``copied=False``: stop (the rest is planned later) where a value must be copied first."""
        if job.files:
            return
        for f, skeleton in list(zip(files, skeletons))[len(planned):]:
            try:
                tree = _fill_slots(skeleton, staged, copied)
            except _NeedsCopiedValue:
                return
            plan = plan_pt(tree, cache=REDUCTIONS)
            planned.append(FileJob(rel_path=f.rel_path, format=f.format, plan=plan, dtypes=plan.dtypes,
                                   json_members=f.json_members, rank=f.rank))
        job.files.extend(planned)

    def plan_ahead() -> None:  # committer thread, before the copies are waited for
        # Pickling needs only the staged buffers' layout, so it runs while the copies are in flight:
        # this Python work then overlaps the device-to-host copy (which training waits for anyway)
        # instead of holding the GIL during the training steps after it. DeferredScalars need the
        # copied values: such files are pickled after the wait.
        plan_files(copied=False)

    def before_write() -> None:  # committer thread
        staged_in_order.copies.wait_host(grace_secs=ENQUEUE_GRACE_SECS)
        clear_step_dir(step_dir)
        plan_files()

    job.before_write = before_write
    job.plan_files = plan_ahead
    if staged_in_order.copies.defer_planning:
        job.plan_when = staged_in_order.copies.training_waits.wait
    return job


def _before_streamed_write(job: SaveJob, files: list[FileContent], skeletons: list[Any], staged: list[torch.Tensor],
                           order: list[int], staged_in_order: StagedTensors, step_dir: str,
                           clear_step_dir: Callable[[str], None]) -> None:
    """``before_write`` under a host budget (committer thread): pickle against placeholders, plan the stream.

    Values needed to pickle (DeferredScalars, e.g. GradScaler's scale) are fetched from the device
    first; every other placeholder becomes a record whose bytes the chunk stream delivers.
    """
    stream: ChunkStream = staged_in_order.copies
    source_of = {order[pos]: src for pos, src in staged_in_order.streamed.items()}  # slot index -> stream source
    staged = list(staged)
    for i in sorted(_deferred_slots(skeletons)):
        if i in source_of:
            staged[i] = stream.fetch(source_of[i])
    by_storage = {staged[i].untyped_storage()._cdata: src for i, src in source_of.items() if staged[i].device.type == "meta"}
    clear_step_dir(step_dir)
    records = []
    for f, skeleton in zip(files, skeletons):
        tree = _fill_slots(skeleton, staged)
        plan = plan_pt(tree, allow_placeholders=True)
        job.files.append(FileJob(rel_path=f.rel_path, format=f.format, plan=plan, dtypes=plan.dtypes,
                                 json_members=f.json_members, rank=f.rank))
        records.append([(key, by_storage[h.untyped_storage()._cdata], h.untyped_storage().nbytes())
                        for key, h in plan.storages if h.device.type == "meta"])
    for fjob, reader in zip(job.files, stream.plan(records)):
        fjob.records = reader
    job.stream = stream


def _deferred_slots(skeletons: list[Any]) -> set[int]:
    """Slot indices that DeferredScalars refer to (their values are needed before pickling)."""
    out: set[int] = set()

    def visit(obj: Any) -> None:
        if isinstance(obj, DeferredScalar):
            if isinstance(obj.tensor, _Slot):
                out.add(obj.tensor.index)
        elif isinstance(obj, dict):
            for v in obj.values():
                visit(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                visit(v)

    for sk in skeletons:
        visit(sk)
    return out


class _NeedsCopiedValue(Exception):
    """A DeferredScalar reads a staged tensor whose copy may not have landed yet."""


def _fill_slots(obj: Any, staged: list[torch.Tensor], copied: bool = True) -> Any:
    """The skeleton with staged tensors in its slots and DeferredScalars turned into numbers, in one walk.

    Containers come out as OrderedDict, dict, list or tuple (what the pickle needs; torch.Size kept).
    ``copied=False``: raise :class:`_NeedsCopiedValue` instead of reading a staged tensor's value.
    """
    if isinstance(obj, _Slot):
        return staged[obj.index]
    if isinstance(obj, DeferredScalar):
        if isinstance(obj.tensor, _Slot) and not copied:
            raise _NeedsCopiedValue
        return obj.as_type(_fill_slots(obj.tensor, staged, copied).item())
    if isinstance(obj, OrderedDict):
        return OrderedDict((k, _fill_slots(v, staged, copied)) for k, v in obj.items())
    if isinstance(obj, dict):
        return {k: _fill_slots(v, staged, copied) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_fill_slots(v, staged, copied) for v in obj]
    if isinstance(obj, tuple) and not isinstance(obj, torch.Size):
        return tuple(_fill_slots(v, staged, copied) for v in obj)
    return obj
