"""What an export wrote: one :class:`ExportedFile` per file, whatever the format."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["ExportedFile"]


@dataclass
class ExportedFile:
    """One file an export wrote."""

    source: str
    """The checkpoint file it was made from (native, safetensors), or the step directory (dcp)."""
    target: str
    """Where it was written, as the user sees it."""
    stored_bytes: int
    """Bytes of ``source`` on storage (0 for the files of a DCP export: they are made from the whole step)."""
    native_bytes: int
    """Bytes written to ``target``."""
    skipped: list[str] = field(default_factory=list)
    """Keys left out of ``target`` (safetensors: state dict values that are not tensors, like ``_extra_state``)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
