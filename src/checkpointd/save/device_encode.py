"""A save written at full speed (a preemption save) with device staging and ``zstd-planes`` on a local
root: its float tensors are encoded on the GPU, from the private copy, and only their frames cross to the
host.

Why: encoding a 4.8 GB state on the host's 16 cores takes about a second (in the persist process), so
a compressed save commits that much later than an uncompressed one (H200, tmpfs: 1.45 s against
0.68). On the GPU it takes ~0.15 s (:mod:`checkpointd.codecs.encode_device`), and fewer bytes cross to
the host and go to the file: the save commits in 0.66 s. Why only at full speed: the encoder's host
side (a few milliseconds of Python per batch, under the GIL) and its kernels run in the training
process, so beside training they cost the steps after a save ~260 ms per checkpoint against ~35 for
an uncompressed one (the host encoder in the persist process costs them nothing). A preemption save
is the one whose time to commit matters most (the grace period waits for it) and that no training
step runs beside; ``writemode.FAST_PERSIST`` makes every save one.

The steps, in the order a save runs them:

1. At the snapshot, :func:`encodes_for`'s predicate picks the cloned tensors to encode (floating point,
   at least :data:`MIN_BYTES`); their device-to-host copies are not queued
   (``device_copies.PendingCopies.encoded``).
2. The committer thread, once the clone is done (``writer.BackgroundWriter.prepare_files``), runs
   :func:`encode_staged`: each tensor's frames go into its own staged host buffer (the frames of a
   record are never larger: one whose would be is copied as it is instead), and the CRC-32 of its native
   bytes (the zip member's) is computed on the device. Then the next snapshot may overwrite the clone.
3. The persist process writes those frames as they are, between the chunks it encodes itself
   (``ptlayout.write_encoded_file``). A file written any other way (no persist process) first gets its
   records' native bytes back (:func:`restore_native`, decoding on the host).

Anything that goes wrong on the device (the kernels do not build, the encoder refuses a batch) copies
the tensors to the host as they are, and the save goes on as without the encoder (logged once).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from checkpointd.codecs import encode_device
from checkpointd.codecs.compress import plane_itemsize
from checkpointd.codecs.planes import decode_chunk_into
from checkpointd.codecs import device_crc

logger = logging.getLogger("checkpointd")

MIN_BYTES = 1 << 20
"""Smaller tensors are copied and encoded on the host with the rest of their file (a frame's headers
and a GPU launch are not worth it)."""


@dataclass
class Encoded:
    """A staged record whose host bytes hold its chunk frames."""

    host: np.ndarray
    frames: list[tuple[int, int, int]]
    """``(offset in host, frame bytes, native bytes)`` of each chunk frame."""
    crc: int
    """CRC-32 of the native bytes."""

    @property
    def native_nbytes(self) -> int:
        return self.host.size


def encodes_for(codec: Any, store: Any, staging: Any, single_process: bool) -> Callable[[torch.Tensor], bool] | None:
    """The snapshot's predicate for a manager writing with ``codec`` to ``store``: None unless device
    staging (``staging``: the manager's ``StagingOptions``, without a host budget) writes ``zstd-planes``
    files to a local root from a single process (the writers that take frames encoded on the device)."""
    if (not single_process or staging.device_budget_bytes is None or staging.host_budget_bytes is not None
            or getattr(codec, "name", None) != "zstd-planes" or not getattr(store, "is_local", False)):
        return None
    if not torch.cuda.is_available():
        return None

    def encodes(t: torch.Tensor) -> bool:
        itemsize, nbytes = plane_itemsize(t.dtype), t.untyped_storage().nbytes()
        return (t.is_cuda and itemsize > 0 and nbytes >= MIN_BYTES and nbytes % itemsize == 0
                and encode_device.available(t.device))

    return encodes


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """Every byte of ``t``'s storage, as a 1-D uint8 tensor (what the serializer writes for it)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


_warned = False


def encode_staged(job: Any, codec: Any) -> None:
    """Encode the snapshot's ``encoded`` tensors from the device clone into their staged host buffers;
    sets ``job.encoded`` (host address -> :class:`Encoded`). Tensors it cannot encode are copied as they
    are. Runs on the committer thread after the clone is done; always releases the clone."""
    global _warned
    copies = job.staged.copies if job.staged is not None else None
    pending = getattr(copies, "encoded", None)
    if not pending:
        return
    done: dict[int, Encoded] = {}
    try:
        device = pending[0][0].device
        records = [encode_device.DeviceRecord(_bytes(src), plane_itemsize(src.dtype), _bytes(dst).numpy())
                   for src, dst in pending]
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            try:
                encode_device.encode_records(records, codec.chunk_bytes, executor=codec.executor)
            except Exception as exc:  # noqa: BLE001 - the tensors are copied as they are instead
                if not _warned:
                    logger.warning("checkpointd: the planes encoder failed on %s (%s); copying the tensors to the "
                                   "host to encode them there", device, exc)
                    _warned = True
                for r in records:
                    r.frames = None
            kept = [(dst, r) for (_, dst), r in zip(pending, records) if r.frames is not None]
            for (_, dst), r in zip(pending, records):
                if r.frames is None:
                    _bytes(dst).copy_(r.data)
            for (dst, r), crc in zip(kept, device_crc.crc32_many([r.data for _, r in kept])):
                done[_bytes(dst).data_ptr()] = Encoded(r.dest, r.frames, crc)
    finally:
        copies.device_reads_done.set()
    job.encoded = done


def restore_native(encoded: dict[int, Encoded], storages: list[tuple[str, torch.Tensor]]) -> None:
    """Put the native bytes back into the staged buffers of ``storages`` that hold frames (a file that
    is written without the persist process), decoding them on the host."""
    for _, t in storages:
        e = encoded.pop(t.data_ptr(), None) if t.device.type == "cpu" and t.numel() else None
        if e is None:
            continue
        native = np.empty(e.native_nbytes, dtype=np.uint8)
        pos = 0
        for at, size, n in e.frames:
            decode_chunk_into(memoryview(e.host[at : at + size]), native[pos : pos + n])
            pos += n
        e.host[:] = native


__all__ = ["MIN_BYTES", "Encoded", "encode_staged", "encodes_for", "restore_native"]
