"""The manifest: what one committed checkpoint holds, as versioned JSON.

The manifest lists every data file (relative path, size, checksum, codec) and where each registered
state entry lives, so a reader never guesses "latest" per file (PhysicsNeMo's weakness 2) and
verification needs nothing but the manifest.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import Any

from .errors import ManifestError

FORMAT_NAME = "checkpointd"
FORMAT_VERSION = 1


@dataclass(kw_only=True)
class FileEntry:
    """One data file of a checkpoint."""

    path: str
    """Relative to the step directory."""
    size: int
    """Bytes on storage (after compression)."""
    checksum: str
    """``crc32:<8 hex>`` of the bytes on storage."""
    codec: str
    """``none`` or the codec name that decodes it back to the native file."""
    format: str
    """``pt`` or ``mdlus``: the native file type after decoding."""
    rank: int = 0
    raw_size: int | None = None
    """Native (decoded) size in bytes, when known."""


@dataclass(kw_only=True)
class EntryLocation:
    """Where one registered state entry lives."""

    kind: str
    """module | optimizer | scheduler | scaler | stateful | tensor | data."""
    file: str
    key: str | None = None
    """Key inside the training-state file; None when the file holds only this entry (module files)."""
    class_name: str | None = None


@dataclass(kw_only=True)
class Manifest:
    step: int
    time: float
    world_size: int
    mode: str
    codec: str
    library_version: str
    torch_version: str
    files: list[FileEntry] = field(default_factory=list)
    entries: dict[str, EntryLocation] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    """Mode-specific details (sharding layout, RNG location)."""

    def to_json(self) -> bytes:
        """Compact JSON, built without copying: the committer thread runs this while training steps run.

        Why not ``json.dumps(asdict(self), indent=1)``: ``asdict`` deep-copies every value and an
        indent selects json's pure-Python encoder. A sharded manifest (two ranks, 240 tensors each:
        140 kB) took 28 ms that way on a 2-core VM, holding the GIL that a CPU-bound training loop
        needs; shallow dictionaries and the C encoder take about 1 ms.
        """
        doc: dict[str, Any] = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION}
        doc.update((f.name, getattr(self, f.name)) for f in fields(self))
        doc["files"] = [_shallow(e) for e in self.files]
        doc["entries"] = {k: _shallow(v) for k, v in self.entries.items()}
        return json.dumps(doc, default=_json_default, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str = "manifest") -> "Manifest":
        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ManifestError(f"{where} is not valid JSON ({exc}); the checkpoint is damaged") from exc
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
            raise ManifestError(f"{where} is not a checkpointd manifest")
        version = doc.get("format_version")
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise ManifestError(
                f"{where} has format_version {version!r}; this checkpointd reads up to {FORMAT_VERSION}: upgrade checkpointd"
            )
        try:
            return cls(
                step=int(doc["step"]),
                time=float(doc["time"]),
                world_size=int(doc["world_size"]),
                mode=str(doc["mode"]),
                codec=str(doc["codec"]),
                library_version=str(doc["library_version"]),
                torch_version=str(doc["torch_version"]),
                files=[FileEntry(**f) for f in doc["files"]],
                entries={k: EntryLocation(**v) for k, v in doc["entries"].items()},
                metrics=dict(doc.get("metrics") or {}),
                extra=dict(doc.get("extra") or {}),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ManifestError(f"{where} is missing or has a malformed field ({exc!r})") from exc

    def file(self, path: str) -> FileEntry:
        for f in self.files:
            if f.path == path:
                return f
        raise ManifestError(f"manifest of step {self.step} lists no file {path!r}")


def _shallow(entry: Any) -> dict[str, Any]:
    return {f.name: getattr(entry, f.name) for f in fields(entry)}


def _json_default(o: Any) -> Any:
    if is_dataclass(o) and not isinstance(o, type):
        return asdict(o)
    try:
        import numbers

        if isinstance(o, numbers.Integral):
            return int(o)
        if isinstance(o, numbers.Real):
            return float(o)
    except Exception:  # pragma: no cover
        pass
    if hasattr(o, "item"):
        return o.item()
    return repr(o)
