"""Tampering with committed checkpoints on local disk, for integrity and safe-loading tests.

Two kinds of change: *damage* (a file altered behind the manifest's back, which verification must
catch) and *forgery* (a file replaced and the manifest and marker rewritten to match, so it passes
integrity checks; safe loading must still refuse what it contains). Also builds ``torch.save``-shaped
files whose pickle would run code, to prove that nothing in checkpointd unpickles unrestricted.
"""

from __future__ import annotations

import io
import json
import pickle
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from checkpointd.codecs.checksum import checksum_bytes, sha256_hex
from checkpointd.codecs.compress import get_codec
from checkpointd.format import layout

__all__ = ["CodeRunner", "forge_file", "malicious_mdlus", "malicious_pt", "recommit", "rewrite_manifest"]


class CodeRunner:
    """Pickles as ``fn(*args)``: unpickling it without restriction calls ``fn``."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.fn, self.args)


def malicious_pt(payload: CodeRunner, *, archive: str = "archive") -> bytes:
    """A zip-format ``torch.save`` file whose ``data.pkl`` is ``{"weight": payload}``."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as zf:
        zf.writestr(f"{archive}/data.pkl", pickle.dumps({"weight": payload}, protocol=2))
        zf.writestr(f"{archive}/.format_version", b"1")
        zf.writestr(f"{archive}/byteorder", sys.byteorder.encode())
        zf.writestr(f"{archive}/version", b"3\n")
    return buf.getvalue()


def malicious_mdlus(payload: CodeRunner) -> bytes:
    """A ``.mdlus`` zip whose ``model.pt`` is :func:`malicious_pt`."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as zf:
        zf.writestr("args.json", json.dumps({"__name__": "Net", "__module__": "x", "__args__": {}}))
        zf.writestr("metadata.json", json.dumps({"mdlus_file_version": "0.2.0", "physicsnemo_version": "2.2.2"}))
        zf.writestr("model.pt", malicious_pt(payload, archive="model"))
    return buf.getvalue()


def rewrite_manifest(step_dir: str | Path, change: Callable[[dict[str, Any]], None], *, commit: bool = True) -> None:
    """Apply ``change`` to the manifest's JSON document; with ``commit``, rewrite the marker to match."""
    path = Path(step_dir) / layout.MANIFEST_NAME
    doc = json.loads(path.read_bytes())
    change(doc)
    path.write_bytes(json.dumps(doc, indent=1).encode())
    if commit:
        recommit(step_dir)


def recommit(step_dir: str | Path) -> None:
    """Write a ``COMMITTED`` marker that matches the current manifest (a forger's last step)."""
    step_dir = Path(step_dir)
    data = (step_dir / layout.MANIFEST_NAME).read_bytes()
    step = json.loads(data)["step"]
    marker = {"manifest": layout.MANIFEST_NAME, "manifest_checksum": sha256_hex(data), "step": step}
    (step_dir / layout.COMMIT_MARKER_NAME).write_text(json.dumps(marker))


def forge_file(step_dir: str | Path, rel: str, native: bytes) -> None:
    """Replace data file ``rel`` by ``native`` (encoded with the file's codec) and make the manifest
    and marker agree, so the step passes every integrity check."""
    step_dir = Path(step_dir)
    doc = json.loads((step_dir / layout.MANIFEST_NAME).read_bytes())
    entry = next(f for f in doc["files"] if f["path"] == rel)
    stored = _encode(entry["codec"], native)
    (step_dir / rel).write_bytes(stored)

    def change(d: dict[str, Any]) -> None:
        for f in d["files"]:
            if f["path"] == rel:
                f.update(size=len(stored), checksum=checksum_bytes(stored), raw_size=len(native))

    rewrite_manifest(step_dir, change)


def _encode(codec_name: str, native: bytes) -> bytes:
    codec = get_codec(codec_name)
    out = io.BytesIO()
    encoder = codec.encoder(out)
    encoder.write(native)
    encoder.close()
    return out.getvalue()
