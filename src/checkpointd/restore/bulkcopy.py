"""Bulk copies of stored (CPU) tensors into live tensors: all pairs at once, finished on return.

Why: ``load_state_dict`` copies tensor by tensor, one synchronous pageable host->device copy at a time
(12-18 GB/s on H100/H200 hosts, far less for the small tensors). Here every host->device pair whose
bytes can be copied as they are (same dtype, same strides, dense: :func:`raw_copyable`) is copied as
bytes, together with the others bound for the same device:

- from a verified device image where the restore verified the file on the GPU
  (:mod:`checkpointd.restore.device_image`), device to device;
- else, when at least :data:`AUTO_MIN_BYTES` go to the device, through the pinned bounce
  (:mod:`checkpointd.restore.bounce`; on an H200 host 4.8 GB land at 49 GB/s);
- else one ``copy_`` per pair (the bounce's threads and pinned chunks cost more than they save).

Everything else (dtype casts, layout changes, CPU destinations) is a plain ``copy_``, exactly what
``load_state_dict`` does. CPU-only builds only ever do plain copies. Every copy is finished (streams
synchronised) before :func:`copy_pairs` returns, so callers and the training loop may use the tensors
at once, on any stream.
"""

from __future__ import annotations

from typing import Sequence

import torch

from checkpointd.restore import device_image
from checkpointd.restore.bounce import Pair, bounced_h2d, device_to_device

AUTO_MIN_BYTES = 32 << 20
"""Below this much host->device data for one device the bounce's threads cost more than they save: the
pairs are copied one ``copy_`` each."""


def is_dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: the elements fill ``[storage_offset, storage_offset + numel)`` exactly."""
    if t.layout != torch.strided:
        return False
    expected = 1
    dims = sorted(((st, s) for s, st in zip(t.shape, t.stride()) if s != 1))
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A dense tensor's memory as a 1-D uint8 view (whatever its strides)."""
    return t.as_strided((t.numel(),), (1,)).view(torch.uint8)


def raw_copyable(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """True when copying ``src`` into ``dst`` is the same as copying their bytes (CPU -> CUDA only)."""
    return (
        dst.device.type == "cuda" and src.device.type == "cpu"
        and dst.dtype == src.dtype and dst.shape == src.shape and dst.stride() == src.stride()
        and dst.numel() > 0 and not dst.is_quantized and not src.is_quantized
        and not src.is_conj() and not src.is_neg() and not dst.is_conj() and not dst.is_neg()
        and type(dst) in (torch.Tensor, torch.nn.Parameter) and type(src) in (torch.Tensor, torch.nn.Parameter)
        and is_dense(dst) and is_dense(src)
    )


def copy_pairs(pairs: Sequence[Pair]) -> None:
    """``dst.copy_(src)`` for every pair, finished on return; byte-copyable CPU -> CUDA pairs in bulk.

    Pairs must have distinct destinations (callers keep the last of duplicates, as a sequential
    ``load_state_dict`` would end with it).
    """
    bulk: dict[torch.device, list[Pair]] = {}
    plain: list[Pair] = []
    with torch.no_grad():
        for dst, src in pairs:
            if raw_copyable(dst, src):
                bulk.setdefault(dst.device, []).append((flat_bytes(dst), flat_bytes(src)))
            else:
                plain.append((dst, src))
        device_image.ensure_host([src for _, src in plain])  # host bytes that only a device image holds yet
        for dst, src in plain:
            dst.copy_(src)
        for device, items in bulk.items():
            bounce = sum(d.numel() for d, _ in items) >= AUTO_MIN_BYTES
            from_image, items = device_image.take_from_images(items, device)
            if from_image:  # verified bytes already on the device (a restore that verified there)
                device_to_device(device, from_image)
            if not items:
                continue
            device_image.ensure_host([src for _, src in items])
            if bounce:
                bounced_h2d(device, items)
            else:
                for d, s in items:
                    d.copy_(s)


__all__ = ["AUTO_MIN_BYTES", "copy_pairs", "flat_bytes", "is_dense", "raw_copyable"]
