"""The committer thread's steps from a snapshot to files ready to write, each a plain function of a :class:`SaveJob`.

``writer.BackgroundWriter._process`` calls them in this order:

1. :func:`plan_files` with ``copied=False`` (``BackgroundWriter.plan_job``): pickle each file
   (``serialize.plan_pt``) while the snapshot's copies are still in flight. Pickling needs only the
   staged buffers' layout, so this Python work overlaps the device-to-host copy (which training waits
   for anyway) instead of holding the GIL during the training steps after it. A file with a
   DeferredScalar needs a copied value: it and the files after it are planned in step 3.
2. :func:`wait_for_copies`: the copies have landed (arena staging), or, under a host budget, the
   values that pickling needs are fetched from the device.
3. :func:`plan_files` (arena staging) or :func:`plan_stream` (host budget: pickle against meta
   placeholders, lay out the chunk stream in each file's record order and give every file its reader).
4. the files are written (``writer.py``); then :func:`release_staging` gives the buffers back.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import torch

from checkpointd.format.serialize import ReductionCache, plan_pt
from checkpointd.format.subclasses import SubclassRecord
from checkpointd.save.job import FileJob, SaveJob, Slot
from checkpointd.state import DeferredScalar

ENQUEUE_GRACE_SECS = 2.0
"""How long the writer lets the training thread's hooks queue a snapshot's copies before queueing them itself."""

REDUCTIONS = ReductionCache()
"""Pickle reductions of the staging buffers, reused by every later save of the same buffers (weakly held)."""


def training_waits(job: SaveJob) -> threading.Event | None:
    """The event a large CUDA snapshot's planning waits for: the training thread reached its next
    optimizer step (see ``device_copies.PendingCopies.training_waits``). None: plan at once."""
    if job.staged is None or job.streamed or not job.staged.copies.defer_planning:
        return None
    return job.staged.copies.training_waits


def plans_ahead(job: SaveJob) -> bool:
    """Whether :func:`plan_files` may run before :func:`wait_for_copies` (arena staging; a streamed
    save plans against placeholders once its deferred values are fetched)."""
    return job.failure is None and not job.streamed


def plan_files(job: SaveJob, copied: bool = True) -> bool:
    """Pickle the files of ``job.sources`` not planned yet into ``job.files``; returns whether all are.

    ``copied=False``: stop at the first file that needs a copied value (a DeferredScalar of a staged
    tensor); the rest is planned by a later call, once :func:`wait_for_copies` returned.
    """
    for src in job.sources[len(job.files):]:
        try:
            tree = fill_slots(src.skeleton, job.slots, copied)
        except NeedsCopiedValue:
            return False
        plan = plan_pt(tree, cache=REDUCTIONS)
        job.files.append(FileJob(rel_path=src.rel_path, format=src.format, plan=plan, dtypes=plan.dtypes,
                                 json_members=src.json_members, rank=src.rank))
    return True


def wait_for_copies(job: SaveJob) -> None:
    """Arena staging: block until the snapshot's copies are in host memory (queueing them after
    :data:`ENQUEUE_GRACE_SECS` if the training thread's hooks did not). Host budget: fetch from the
    device the values that pickling needs (DeferredScalars, e.g. GradScaler's scale) into ``job.slots``;
    every other placeholder's bytes are delivered by the chunk stream while the files are written."""
    if job.staged is None:
        return
    if not job.streamed:
        job.staged.copies.wait_host(grace_secs=ENQUEUE_GRACE_SECS)
        return
    source_of = stream_sources(job)
    for i in sorted(deferred_slots([src.skeleton for src in job.sources])):
        if i in source_of:
            job.slots[i] = job.staged.copies.fetch(source_of[i])


def plan_stream(job: SaveJob) -> None:
    """Host budget: pickle every file against the placeholders and lay out the chunk stream that
    delivers their bytes; sets each file's ``records`` reader and ``job.stream``."""
    assert job.staged is not None
    stream = job.staged.copies
    source_of = stream_sources(job)
    by_storage = {job.slots[i].untyped_storage()._cdata: src for i, src in source_of.items()
                  if job.slots[i].device.type == "meta"}
    records = []
    for src in job.sources:
        tree = fill_slots(src.skeleton, job.slots)
        plan = plan_pt(tree, allow_placeholders=True)
        job.files.append(FileJob(rel_path=src.rel_path, format=src.format, plan=plan, dtypes=plan.dtypes,
                                 json_members=src.json_members, rank=src.rank))
        records.append([(key, by_storage[h.untyped_storage()._cdata], h.untyped_storage().nbytes())
                        for key, h in plan.storages if h.device.type == "meta"])
    for fjob, reader in zip(job.files, stream.plan(records)):
        fjob.records = reader
    job.stream = stream


def release_staging(job: SaveJob) -> None:
    """Give the snapshot's buffers back (its arena to the pool; under a host budget, the chunk ring).

    Runs once every file is written, or the save failed before writing: a file being written reads
    those buffers. Runs once per job (a second call does nothing).
    """
    snapshotter, job.snapshotter = job.snapshotter, None
    if snapshotter is not None and job.staged is not None:
        snapshotter.release(job.staged)


def stream_sources(job: SaveJob) -> dict[int, int]:
    """Host budget: slot index -> source index in the chunk stream, for every streamed tensor."""
    assert job.staged is not None
    return {job.order[pos]: src for pos, src in job.staged.streamed.items()}


def deferred_slots(skeletons: list[Any]) -> set[int]:
    """Slot indices that DeferredScalars refer to (their values are needed before pickling)."""
    out: set[int] = set()

    def visit(obj: Any) -> None:
        if isinstance(obj, DeferredScalar):
            if isinstance(obj.tensor, Slot):
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


class NeedsCopiedValue(Exception):
    """A DeferredScalar reads a staged tensor whose copy may not have landed yet."""


def fill_slots(obj: Any, staged: list[torch.Tensor], copied: bool = True) -> Any:
    """The skeleton with staged tensors in its slots and DeferredScalars turned into numbers, in one walk.

    Containers come out as OrderedDict, dict, list or tuple (what the pickle needs; torch.Size kept);
    a tensor subclass's record gets its staged inner tensors.
    ``copied=False``: raise :class:`NeedsCopiedValue` instead of reading a staged tensor's value.
    """
    if isinstance(obj, Slot):
        return staged[obj.index]
    if isinstance(obj, DeferredScalar):
        if isinstance(obj.tensor, Slot) and not copied:
            raise NeedsCopiedValue
        return obj.as_type(fill_slots(obj.tensor, staged, copied).item())
    if isinstance(obj, SubclassRecord):  # its inner tensors' slots
        return obj.mapped(lambda v: fill_slots(v, staged, copied))
    if isinstance(obj, OrderedDict):
        return OrderedDict((k, fill_slots(v, staged, copied)) for k, v in obj.items())
    if isinstance(obj, dict):
        return {k: fill_slots(v, staged, copied) for k, v in obj.items()}
    if isinstance(obj, list):
        return [fill_slots(v, staged, copied) for v in obj]
    if isinstance(obj, tuple) and not isinstance(obj, torch.Size):
        return tuple(fill_slots(v, staged, copied) for v in obj)
    return obj
