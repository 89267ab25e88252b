"""What every writer behind ``Store.open_write`` is: a binary sink that commits on ``close()`` only and
throws its data away on ``abort()``, and leaves a ``with`` block by committing, or aborting on an exception.

Why not fsspec's own file objects: closing one commits whatever was written, also when the ``with``
block is left by an exception, and a partial object must never look complete.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any, Protocol


class WriteFile(Protocol):
    """What ``Store.open_write`` returns: a binary sink that commits on ``close()`` only."""

    def write(self, data: Any) -> int: ...
    def tell(self) -> int: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...
    def abort(self) -> None: ...
    def discard(self) -> None: ...
    def __enter__(self) -> WriteFile: ...
    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None, /
    ) -> None: ...



class WriterBase:
    """Context-manager behaviour shared by the writers: commit on success, abort on exception.

    Subclasses define ``write``, ``tell``, ``close`` (commit) and ``abort``."""

    def __enter__(self) -> Any:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def flush(self) -> None:
        """No-op: data becomes durable on ``close()`` only."""

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False

    def seekable(self) -> bool:
        return False

    def close(self) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError

    def discard(self) -> None:
        """fsspec's name for :meth:`abort`."""
        self.abort()


__all__ = ["WriteFile", "WriterBase"]
