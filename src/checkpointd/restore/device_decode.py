"""Decode a local ``zstd-planes`` file on the restore's device, begun before its checksum is known.

A restore that verifies on the device (:mod:`checkpointd.restore.device_image`) uploads a planes file
whole and checksums it there; the file is then decoded there too (:mod:`checkpointd.codecs.planes_device`).
Its registered image is the native file on the device, while the host buffer the unpickler builds
tensors on holds only the bytes the host decoded (zip headers, pickles, chunks that are not planes);
the rest is copied back only where the host reads it (:func:`checkpointd.restore.device_image.ensure_host`).

Both parts of the decoding read only the stored bytes, so both begin before the checksum is known, and
what they find, errors included, counts only once the file matched it (:func:`decode_planes`):

- the host's part (:func:`checkpointd.codecs.planes_device.prepare`: every chunk's layout checked, the
  small chunks decoded on the host, the merge kernel's table laid out) runs beside the uploads on one
  planning thread, file after file in the order they were started (:meth:`PlanesDecoding.start`; as a
  rule the largest first: its read starts first, and it is uploaded first). With a thread per file the two plannings competed for the
  GIL and often ended after the first upload (H200 host, 4.83 GB, 8 restores: the larger file's 46-609 ms
  against 21-49 on one thread; restores 216 ms median against 182);
- the device's part is queued on a stream of its own once the upload has finished, after the checksum's
  kernels and before their result is read back (:meth:`PlanesDecoding.uploaded`). The device then
  decodes while the host compares the checksum and parses the other files, and its launches do not wait
  for the GIL behind those parses.

Measured on an H200 host (4.83 GB, two files, tmpfs): run after the checksum, each part took 20-26 ms of
the restore's critical path.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from checkpointd.codecs.compress import default_executor
from checkpointd.codecs.container import PLANES_FOOTER_MAGIC, ViewFile, read_index
from checkpointd.codecs.encode_kernels import stream_for
from checkpointd.codecs.planes_device import OnDevice, Prepared, decode_on_device, prepare
from checkpointd.errors import CorruptCheckpointError
from checkpointd.format.streams import byte_view
from checkpointd.restore.bounce import bounced_h2d
from checkpointd.restore.device_image import DeviceImage, allocate, count

logger = logging.getLogger("checkpointd")


class PlanesDecoding:
    """One file's decoding on the device, begun beside its upload (:func:`checkpointd.restore.device_image.verify`
    calls :meth:`start` and :meth:`uploaded`) and taken by :func:`decode_planes` once its checksum matched."""

    def __init__(self, buf: torch.Tensor, native_size: int | None) -> None:
        self.buf = buf
        self.native_size = native_size
        """The native size the manifest gives."""
        self.prepared: Future[Prepared] | None = None
        self.queued: OnDevice | None = None

    def start(self, device: torch.device) -> None:
        """The host's part, queued for the planning thread, while the file is uploaded to ``device``."""
        self.prepared = _planner().submit(prepare, byte_view(self.buf), device, default_executor(), False)

    def uploaded(self, data: torch.Tensor) -> None:
        """Queue the device's part on the decode stream (not waited for); ``data``: the file, uploaded.

        Nothing is queued where the host's part failed, the file's native size is not the manifest's,
        there is no room or the device fails: :func:`decode_planes` decodes after the checksum then, and
        reports what it finds.
        """
        try:
            p = self.prepared.result() if self.prepared is not None else None
            if p is None or self.native_size is None or p.host.numel() != self.native_size:
                return
            native_data = allocate(self.buf, self.native_size)
            if native_data is None:
                return
            self.queued = decode_on_device(byte_view(self.buf), data, default_executor(), upload=_copy_pairs_up,
                                           check_chunks=False, data=native_data, wait=False, prepared=p,
                                           stream=stream_for(data.device, "decode"))
        except Exception as exc:  # noqa: BLE001 - decoded again after the checksum, where an error counts
            logger.debug("restore: the device's decoding of a %d-byte file did not start early (%r)", self.buf.numel(), exc)


_planning: ThreadPoolExecutor | None = None
_planning_lock = threading.Lock()


def _planner() -> ThreadPoolExecutor:
    """The planning thread (:meth:`PlanesDecoding.start`), started on first use (in a forked child, again)."""
    global _planning
    with _planning_lock:
        if _planning is None:
            _planning = ThreadPoolExecutor(1, thread_name_prefix="checkpointd-plan")
        return _planning


def _forget_planner_in_child() -> None:
    global _planning, _planning_lock
    _planning, _planning_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_planner_in_child)


def decode_planes(buf: torch.Tensor, stored: DeviceImage | None, native_size: int | None = None) -> DeviceImage | None:
    """The native bytes of the verified ``zstd-planes`` file ``buf`` decoded on the restore's device
    (:mod:`checkpointd.codecs.planes_device`), as an image whose host holds only what the host decoded.

    ``native_size``: the native size the manifest gives (a file that says otherwise is damaged). ``buf``
    matched its manifest checksum, which covers every byte the chunks' own CRCs cover, so those are
    not computed again. ``stored``: ``buf`` already on the device (the image of
    :func:`checkpointd.restore.device_image.verify`, with its :class:`PlanesDecoding`), else it is
    uploaded here. None where that does not apply or the device failed (logged): the caller decodes on
    the host. The result's host bytes are written and may be parsed while the device still decodes;
    register it (:func:`checkpointd.restore.device_image.register`, which waits for the device and takes
    its verdict), and read its other host bytes only through
    :func:`checkpointd.restore.device_image.ensure_host`.

    Raises:
        CorruptCheckpointError: a damaged file, as the host decoder would find it (what only the device
            finds is raised by ``register`` or by a copy back to the host).
    """
    native = read_index(ViewFile(byte_view(buf)), PLANES_FOOTER_MAGIC, "zstd-planes")[1][-1]
    if native_size is not None and native != native_size:
        raise CorruptCheckpointError(f"the 'zstd-planes' file holds {native} native bytes, its manifest says {native_size}")
    begun = stored.planes if stored is not None and isinstance(stored.planes, PlanesDecoding) else None
    if begun is not None and begun.queued is not None:  # the checksum matched since it was queued
        out, begun.queued = begun.queued, None
        count(decoded=1)
        return DeviceImage(out.host, out.data, out.device_only, out.check)
    data = stored.data if stored is not None else allocate(buf)
    native_data = allocate(buf, native) if data is not None else None
    if data is None or native_data is None:
        return None
    try:
        if stored is None:
            _copy_pairs_up([(data, buf)])
        prepared = begun.prepared.result() if begun is not None and begun.prepared is not None else None
        out = decode_on_device(byte_view(buf), data, default_executor(), upload=_copy_pairs_up, check_chunks=False,
                               data=native_data, wait=False, prepared=prepared)
    except CorruptCheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - out of memory, a CUDA error: the host decoder needs none of it
        logger.warning("restore: decoding a %d-byte file on %s failed (%r); decoding it on the host",
                       buf.numel(), data.device, exc)
        count(failed=1)
        return None
    count(decoded=1)
    return DeviceImage(out.host, out.data, out.device_only, out.check)


def _copy_pairs_up(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``dst.copy_(src)`` for every pair (host to device), through the pinned bounce on CUDA."""
    if pairs and pairs[0][0].device.type == "cuda":
        bounced_h2d(pairs[0][0].device, pairs)
    else:  # a CPU "device" (tests)
        for dst, src in pairs:
            dst.copy_(src)


__all__ = ["PlanesDecoding", "decode_planes"]
