"""What one save is, as data handed from stage to stage: :class:`SaveJob` and its :class:`FileJob` files.

The training thread (``savejob.stage_save``) fills the sources, the slots and the snapshot; the
committer thread (``writer.BackgroundWriter``) runs the named steps of ``planning.py`` on it, writes
its files, the manifest and the commit marker, and records the outcome on it. A job carries no
callables: what runs on it is the writer's code and the hooks the writer was built with.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from checkpointd.format.manifest import Manifest
from checkpointd.format.serialize import PtPlan
from checkpointd.save.chunkstream import ChunkStream
from checkpointd.save.snapshot import Snapshotter, StagedTensors


class Slot:
    """Placeholder for the i-th staged tensor inside a tree skeleton."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


@dataclass
class FileSource:
    """One file of a save as the training thread hands it over: its tree with every tensor a :class:`Slot`."""

    rel_path: str
    format: str
    skeleton: Any
    json_members: dict[str, bytes] | None = None
    rank: int = 0


@dataclass
class FileJob:
    """One file of a save: its plan (pickle + staged tensor storages) and format."""

    rel_path: str
    format: str
    plan: PtPlan
    dtypes: dict[str, Any]
    json_members: dict[str, bytes] | None = None
    rank: int = 0
    records: Any = None
    """Host budget: the ``chunkstream.FileRecords`` that deliver the bytes of the plan's placeholder records."""
    image: Any = None
    """Positional writes: the file's ``ptlayout.ZipImage``, laid out ahead (see ``BackgroundWriter.plan_job``)."""
    encoded: dict[int, Any] | None = None
    """Device encoding: the job's records whose staged bytes hold their frames (``SaveJob.encoded``)."""
    recycled: bool = False
    """Set by the write: the file was written over one taken from the recycling bin (retired, or blank
    made ahead), not created. Why kept: whether a save found its files is what decides its write speed
    on tmpfs (``stats()["last_save"]["files_recycled"]``)."""


@dataclass
class SaveJob:
    """One save, from the snapshot to the commit marker."""

    step: int
    step_dir: str
    manifest: Manifest
    """The manifest's pieces; the writer fills its ``files`` once every file is written."""
    sources: list[FileSource] = field(default_factory=list)
    slots: list[torch.Tensor] = field(default_factory=list)
    """Slot index -> staged tensor (a meta placeholder for a tensor that a host budget's stream delivers)."""
    order: list[int] = field(default_factory=list)
    """Position in ``staged.staged`` -> slot index (the snapshot stages the modules' buffers first)."""
    staged: StagedTensors | None = None
    """The snapshot: the staged tensors, their arena and their copies in flight (a ``ChunkStream`` under a host budget)."""
    snapshotter: Snapshotter | None = None
    """Owner of ``staged``'s buffers: ``planning.release_staging`` gives them back to it."""
    files: list[FileJob] = field(default_factory=list)
    """The planned files, in the order of ``sources`` (filled by ``planning.plan_files`` / ``plan_stream``)."""
    stream: ChunkStream | None = None
    """Host budget: the ``ChunkStream`` that ``write_files`` runs while the files are written (set by ``plan_stream``)."""
    encoded: dict[int, Any] = field(default_factory=dict)
    """Device staging with a device encoder: host address of a staged buffer -> its frames
    (``device_encode.Encoded``), set by ``device_encode.encode_staged``."""
    failure: BaseException | None = None
    """A save that failed before it reached the writer (a distributed rank's staging): the writer raises it
    in place of writing, still taking part in the commit protocol."""
    fast: bool = False
    """Write every file at full speed (a preemption save, or every save with ``writemode.FAST_PERSIST``), not gently."""
    future: Future = field(default_factory=Future)
    timings: dict[str, float] = field(default_factory=dict)
    written_bytes: int = 0
    raw_bytes: int = 0

    @property
    def streamed(self) -> bool:
        """Whether the bytes go through a host budget's chunk stream (not a staging arena)."""
        return self.staged is not None and isinstance(self.staged.copies, ChunkStream)
