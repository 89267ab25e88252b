"""How a host-budget stream copies its pieces into a chunk: on the side stream (CUDA) or plainly (CPU).

The copy is a parameter of :class:`~checkpointd.save.chunkstream.ChunkStream`, so the ring, the
planning, the waits and the writers run on CPU-only machines in tests: :class:`CpuCopier` copies
synchronously, :class:`CudaCopier` queues device-to-host copies on the side stream, ordered after the
save point, with one host-waitable event per chunk. A piece is anything with ``src``, ``start``,
``length`` and ``chunk_offset`` (``chunkstream.Part``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from checkpointd.save.arena import is_dense, span_elems
from checkpointd.save.device_copies import host_waited_event


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """1-D uint8 view of the bytes a staging buffer of ``t`` holds (its dense span; else contiguous)."""
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    if not is_dense(t):
        t = t.contiguous()
    span = span_elems(t.shape, t.stride())
    return torch.as_strided(t, (span,), (1,)).view(torch.uint8)


class CpuCopier:
    """Plain synchronous copies (CPU tensors; the ring logic in tests)."""

    def __init__(self) -> None:
        self._views: dict[int, torch.Tensor] = {}

    def copy(self, parts: Sequence[Any], sources: Sequence[torch.Tensor], buf: torch.Tensor) -> Any:
        with torch.no_grad():
            for p in parts:
                src = self._view(p.src, sources)
                buf[p.chunk_offset:p.chunk_offset + p.length].copy_(src[p.start:p.start + p.length])
        return None

    def _view(self, i: int, sources: Sequence[torch.Tensor]) -> torch.Tensor:
        v = self._views.get(i)
        if v is None:
            v = self._views[i] = byte_view(sources[i])
        return v

    def fetch(self, src: torch.Tensor) -> torch.Tensor:
        return src.detach().clone()

    def wait_host(self, handle: Any) -> None:
        pass

    def order_compute_after(self, handle: Any) -> None:
        pass

    def close(self) -> None:
        self._views.clear()


class CudaCopier(CpuCopier):
    """Device-to-host copies on the side stream, ordered after the save point; one event per chunk."""

    def __init__(self, stream: Any, save_point: Any, device: torch.device,
                 before: Callable[[], None] | None = None) -> None:
        """``before``: queues what the first copy must follow on the same stream (device staging's clone)."""
        super().__init__()
        self.stream = stream
        self.save_point = save_point
        self.device = device
        self._before = before
        self._started = False

    def _begin(self) -> None:
        if not self._started:
            if self._before is not None:
                self._before()
            self.stream.wait_event(self.save_point)
            self._started = True

    def copy(self, parts: Sequence[Any], sources: Sequence[torch.Tensor], buf: torch.Tensor) -> Any:
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream), torch.no_grad():
            self._begin()
            for p in parts:
                src = self._view(p.src, sources)  # non-dense sources: a contiguous copy on this stream
                buf[p.chunk_offset:p.chunk_offset + p.length].copy_(src[p.start:p.start + p.length], non_blocking=True)
            event = host_waited_event()
            event.record(self.stream)
        return event

    def fetch(self, src: torch.Tensor) -> torch.Tensor:
        """A small tensor's value now (GradScaler scale): synchronous copy on the side stream."""
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream), torch.no_grad():
            self._begin()
            out = src.detach().to("cpu")
        return out

    def wait_host(self, handle: Any) -> None:
        if handle is not None:
            handle.synchronize()

    def order_compute_after(self, handle: Any) -> None:
        if handle is not None:
            torch.cuda.current_stream(self.device).wait_event(handle)

    def close(self) -> None:
        if self._started:
            self.stream.synchronize()
        super().close()
