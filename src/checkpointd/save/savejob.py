"""From validated file trees to a background job: collect tensors, snapshot them, hand the job over.

This is the seam between the training thread and the committer thread. On the training thread,
:func:`stage_save` walks each file's tree, replaces every tensor by a slot (deduplicating tensors that
appear twice, e.g. tied weights), and hands the tensors to the snapshot stage. The :class:`SaveJob` it
returns is data: the file sources (skeletons), the slot -> staged tensor list and the snapshot. The
committer thread (``writer.py``) runs the steps of ``planning.py`` on it: wait for the copies, fill
the slots with the staged buffers and pickle each file (``serialize.plan_pt``).

Under a host staging budget the staged "buffers" of device tensors are meta placeholders: pickling
needs only their layout (``planning.plan_stream``); the writer streams the bytes.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

import torch

from checkpointd.storage import filesahead
from checkpointd.storage import recyclebin
from checkpointd.version import VERSION
from checkpointd.format import layout
from checkpointd.format.manifest import EntryLocation, Manifest
from checkpointd.format.serialize import plan_pt
from checkpointd.format.subclasses import SubclassRecord, describe_records, is_stored_subclass
from checkpointd.save.job import FileSource, SaveJob, Slot
from checkpointd.save.planning import REDUCTIONS
from checkpointd.save.snapshot import Snapshotter
from checkpointd.save.arena import TensorSpec, tensor_spec
from checkpointd.state import Entry, FileContent, copy_tree
from checkpointd.storage import persist_process

logger = logging.getLogger("checkpointd")

def prewarm_reductions(arena: Any) -> None:
    """Pickle an arena's buffers once, on the thread that prepared it ahead, to fill :data:`REDUCTIONS`.

    The first save's pickling otherwise builds every buffer's reduction (~20 us a tensor) on the
    committer thread during the steps right after the save point, holding the GIL that a launch-bound
    training loop needs (a 0.45 GB state's first checkpoint costs 32-34 ms against ~12 for the later
    ones on an H100 host). The buffers are the very tensors the saves pickle, so the entries hit.
    """
    buffers = [b for b in arena.buffers if b.numel()]
    if not buffers:
        return
    try:
        plan_pt(buffers, cache=REDUCTIONS)
    except Exception as exc:  # noqa: BLE001 - only a warm-up: the save pickles them itself
        logger.debug("checkpointd: could not pre-pickle the staging buffers: %s", exc)


def collect_tensors(trees: Sequence[Any], records: dict[int, SubclassRecord] | None = None) -> tuple[list[Any], list[torch.Tensor]]:
    """Skeletons of ``trees`` (tensors replaced by slots) and the distinct tensors, in walk order.

    Two entries are one tensor (stored once, e.g. tied weights) when they are the same view of the same
    memory. A tensor subclass becomes a :class:`~checkpointd.format.subclasses.SubclassRecord` whose inner
    tensors are slots (staged like any tensor, never dequantized); the same object twice is one record. Most tensors start at an address no other one does, so the full view key is built only for
    those that share one: this runs on the training thread for every tensor of every save.
    """
    tensors: list[torch.Tensor] = []
    at_address: dict[int, list[int]] = {}
    records = {} if records is None else records

    def collect(t: torch.Tensor) -> Any:
        if type(t) not in _PLAIN and is_stored_subclass(t):  # validated: its inner tensors become slots
            record = records.get(id(t))
            if record is None:
                record = records[id(t)] = SubclassRecord.of(t, collect)
            return record
        ptr = t.data_ptr()
        same_start = at_address.get(ptr) if ptr else None  # empty tensors share data_ptr 0: never merge them
        if same_start is not None:
            key = _view_key(t)
            for j in same_start:
                if _view_key(tensors[j]) == key:
                    return Slot(j)
            same_start.append(len(tensors))
        elif ptr:
            at_address[ptr] = [len(tensors)]
        tensors.append(t)
        return Slot(len(tensors) - 1)

    return [copy_tree(tree, collect) for tree in trees], tensors


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def subclass_extra(files: Sequence[FileContent], skeletons: Sequence[Any], tensors: Sequence[torch.Tensor]) -> dict[str, Any]:
    """``{file: {key path: description}}`` of the tensor subclasses in ``skeletons`` (the manifest's
    ``extra["subclasses"]``); empty when there are none."""
    def inner_layout(slot: Any) -> tuple[str, list[int]]:
        t = tensors[slot.index]
        return str(t.dtype).removeprefix("torch."), list(t.shape)

    out = {}
    for f, skeleton in zip(files, skeletons):
        described = describe_records(skeleton, inner_layout)
        if described:
            out[f.rel_path] = described
    return out


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
    """Blank files for the first saves of ``files`` (:class:`checkpointd.storage.filesahead.FilesAhead`), started
    (made once ``busy()`` is False); None where saves would not take them (no recycling, a codec,
    streaming writes) or they are turned off."""
    sets = filesahead.FilesAhead.sets_wanted()
    if sets == 0 or not recyclebin.enabled(store) or getattr(codec, "name", None) != "none":
        return None
    ahead = filesahead.FilesAhead(store, blank_file_sizes(files), sets, premap=persist_process.keep_blank_file, busy=busy,
                               saves_started=saves_started)
    ahead.start()
    return ahead


def blank_file_sizes(files: Sequence[FileContent]) -> list[int]:
    """The sizes of blank files that one save of ``files`` would take (:func:`checkpointd.storage.filesahead.sizes_ahead`)."""
    tensor_bytes = []
    for f in files:
        _, tensors = collect_tensors([f.tree])
        tensor_bytes.append(sum(t.numel() * t.element_size() for t in tensors))
    return filesahead.sizes_ahead(tensor_bytes)


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
    fast: bool = False,
) -> SaveJob:
    """Snapshot every tensor of ``files`` (training thread) and return the job that writes them.

    Nothing is pickled here: the committer thread plans the files (``planning.py``). ``fast``: a save
    written at full speed rather than gently beside training (``SaveJob.fast``); with device staging its
    float tensors may be encoded on the GPU (``Snapshotter.snapshot``).
    """
    records: dict[int, SubclassRecord] = {}
    skeletons, tensors = collect_tensors([f.tree for f in files], records)
    if records:  # the manifest lists them: a restore refuses a class it does not accept before unpickling
        extra = {**extra, "subclasses": subclass_extra(files, skeletons, tensors)}
    order, n_buffers = buffers_first(entries, tensors)
    staged_in_order = snapshotter.snapshot([tensors[i] for i in order], n_buffer_tensors=n_buffers, encode_on_device=fast)
    staged: list[torch.Tensor] = [None] * len(tensors)  # type: ignore[list-item]
    for pos, i in enumerate(order):
        staged[i] = staged_in_order.staged[pos]
    manifest = Manifest(step=step, time=time.time(), world_size=world_size, mode=mode, codec=codec_name,
                        library_version=VERSION, torch_version=torch.__version__, metrics=metrics,
                        entries=entry_locations(entries, files) if locations is None else locations,
                        extra=extra)
    sources = [FileSource(rel_path=f.rel_path, format=f.format, skeleton=skeleton, json_members=f.json_members,
                          rank=f.rank) for f, skeleton in zip(files, skeletons)]
    return SaveJob(step=step, step_dir=layout.step_dir_name(step), manifest=manifest, sources=sources, slots=staged,
                   order=order, staged=staged_in_order, snapshotter=snapshotter, fast=fast)
