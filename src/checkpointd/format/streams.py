"""Small file-like adapters shared by the writers and readers.

``zipfile`` and ``torch.load`` want file objects; the pipeline has sinks (anything with ``write``) and
byte ranges. These adapters are the only glue between the two, so each exists once.
"""

from __future__ import annotations

import io
from types import TracebackType
from typing import Any, Protocol

import torch


class ReadStream(Protocol):
    """What the readers take: a readable, seekable binary stream.

    Files (``IO[bytes]``, ``io.BytesIO``) and the :class:`SeekableReader` adapters below all qualify.
    """

    def read(self, size: int = -1, /) -> bytes: ...
    def seek(self, offset: int, whence: int = 0, /) -> int: ...
    def tell(self) -> int: ...
    def seekable(self) -> bool: ...
    def close(self) -> None: ...
    def __enter__(self) -> ReadStream: ...
    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None, /
    ) -> None: ...


class WriteOnlyStream(io.RawIOBase):
    """Presents a sink to ``zipfile`` as a write-only, unseekable stream.

    Unseekable on purpose: ``zipfile`` then streams members with data descriptors instead of seeking
    back to patch headers, which object-store uploads and codec streams cannot do.
    """

    def __init__(self, sink: Any) -> None:
        self._sink = sink

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def write(self, data: Any) -> int:  # type: ignore[override]
        view = memoryview(data)
        self._sink.write(view)
        return view.nbytes

    def flush(self) -> None:
        pass


class SeekableReader(io.RawIOBase):
    """Read-only, seekable stream over ``extent()`` bytes; subclasses implement ``readinto`` at ``_pos``."""

    _pos: int = 0

    def extent(self) -> int:
        """Total length in bytes."""
        raise NotImplementedError

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.extent()}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos


def byte_view(t: torch.Tensor) -> memoryview:
    """A zero-copy ``memoryview`` (format ``B``) of a contiguous CPU tensor's bytes; empty for no bytes."""
    if t.numel() == 0:
        return memoryview(b"")
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"byte_view needs a contiguous CPU tensor, got {t.device} strides {t.stride()}")
    return memoryview(t.view(-1).view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]  # ndarray is a buffer
