"""Malformed content, signed by the attacker so that it passes the marker check (and, for data files,
the CRC-32): every case is a damaged step. ``checkpointd.load`` raises a CheckpointError subclass
(never a raw AttributeError/TypeError/KeyError/IsADirectoryError/RecursionError/...), ``checkpointd
verify`` exits non-zero, and ``restore_latest`` falls back to the previous step bit-exact, with a
warning naming the damaged one."""

from __future__ import annotations

import io
import json
import re
import struct
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import checkpointd
from checkpointd import CheckpointError
from checkpointd.format import layout

from . import craft
from .craft import BAD, GOOD


def _doc(change: Callable[[dict[str, Any]], Any]) -> Callable[[Path], None]:
    return lambda d: craft.edit_manifest(d, change)


def _raw(text: bytes | Callable[[Path], bytes]) -> Callable[[Path], None]:
    return lambda d: craft.sign_raw_manifest(d, text(d) if callable(text) else text)


def _manifest_text(d: Path) -> str:
    return (d / layout.MANIFEST_NAME).read_text()


def _with_step(d: Path, text: str) -> bytes:
    """The manifest with its step field's value replaced by ``text`` (raw JSON)."""
    out, n = re.subn(rf'"step":\s*{BAD}\b', f'"step": {text}', _manifest_text(d), count=1)
    assert n == 1, "the manifest has no step field to replace"
    return out.encode()


def _set_file(field: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(doc: dict[str, Any]) -> None:
        doc["files"][0][field] = value
    return change


def _manifest_is_dir(d: Path) -> None:
    (d / layout.MANIFEST_NAME).unlink()
    (d / layout.MANIFEST_NAME).mkdir()


def _replace_data(d: Path, make: Callable[[bytes], bytes], rel: str | None = None) -> None:
    rel = rel or craft.data_file(d)
    craft.forge_native(d, rel, make(craft.native_bytes(d, rel)))


def _edit_state_file(change: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    """Rewrite the training-state file's dict (with torch.save) and re-sign it."""
    def attack(d: Path) -> None:
        def make(native: bytes) -> bytes:
            content = torch.load(io.BytesIO(native), weights_only=True)
            change(content)
            return craft.torch_save_bytes(content)
        _replace_data(d, make)
    return attack


def _central_directory(native: bytes, patch: Callable[[bytearray, int, int], None]) -> bytes:
    """Apply ``patch(buf, offset of a central directory record, its index)`` to every record."""
    buf = bytearray(native)
    with zipfile.ZipFile(io.BytesIO(native)) as zf:
        count = len(zf.infolist())
    at = buf.rfind(b"PK\x01\x02", 0, len(buf))
    starts = []
    pos = 0
    while (pos := buf.find(b"PK\x01\x02", pos)) != -1:
        starts.append(pos)
        pos += 4
    assert len(starts) >= count and at in starts
    for i, off in enumerate(starts[:count]):
        patch(buf, off, i)
    return bytes(buf)


def _cd_huge_sizes(buf: bytearray, off: int, i: int) -> None:
    struct.pack_into("<II", buf, off + 20, 0xFFFFFFF0, 0xFFFFFFF0)  # compressed, uncompressed size


def _cd_overlapping(buf: bytearray, off: int, i: int) -> None:
    struct.pack_into("<I", buf, off + 42, 0)  # every record's local header at offset 0


def _rng_wrong_type(content: dict[str, Any]) -> None:
    content["checkpointd_rng"] = {"python": "not a state", "torch": torch.zeros(3, dtype=torch.float64)}


def _deep_json(d: Path) -> bytes:
    return b"[" * 200_000 + b"]" * 200_000


CASES: dict[str, Callable[[Path], None]] = {
    "manifest-top-level-list": _raw(b"[]"),
    "manifest-list-of-manifest": _raw(lambda d: b"[" + _manifest_text(d).encode() + b"]"),
    "manifest-files-is-object": _doc(lambda doc: doc.update(files={f["path"]: f for f in doc["files"]})),
    "manifest-file-entry-is-list": _doc(lambda doc: doc.update(files=[list(f.values()) for f in doc["files"]])),
    "manifest-entries-is-list": _doc(lambda doc: doc.update(entries=list(doc["entries"].values()))),
    "manifest-entry-is-list": _doc(lambda doc: doc["entries"].update(model=list(doc["entries"]["model"].values()))),
    "manifest-is-directory": _manifest_is_dir,
    "manifest-200k-deep": _raw(_deep_json),
    "manifest-not-utf8": _raw(lambda d: _manifest_text(d).replace('"full"', '"f\udcffull"', 1).encode("utf-8", "surrogateescape")),
    "size-string": _doc(lambda doc: doc["files"][0].update(size=str(doc["files"][0]["size"]))),
    "size-negative": _doc(_set_file("size", -1)),
    "size-bool": _doc(_set_file("size", True)),
    "size-float": _doc(lambda doc: doc["files"][0].update(size=float(doc["files"][0]["size"]))),
    "size-huge": _doc(_set_file("size", 10 ** 40)),
    "checksum-int": _doc(_set_file("checksum", 12345)),
    "checksum-list": _doc(lambda doc: doc["files"][0].update(checksum=[doc["files"][0]["checksum"]])),
    "checksum-null": _doc(_set_file("checksum", None)),
    "codec-unknown": _doc(lambda doc: [f.update(codec="rot13") for f in doc["files"]]),
    "format-unknown": _doc(lambda doc: [f.update(format="exe") for f in doc["files"]]),
    "format-version-future": _doc(lambda doc: doc.update(format_version=2)),
    "format-version-string": _doc(lambda doc: doc.update(format_version="1")),
    "step-differs": _doc(lambda doc: doc.update(step=BAD + 1)),
    "step-string": _doc(lambda doc: doc.update(step=str(BAD))),
    "step-infinity": _raw(lambda d: _with_step(d, "Infinity")),
    "step-nan": _raw(lambda d: _with_step(d, "NaN")),
    "duplicate-keys": _raw(lambda d: _with_step(d, f"{GOOD}, \"step\": {BAD}")),
    "entries-file-not-listed": _doc(lambda doc: doc["entries"]["model"].update(file="missing.pt")),
    "entries-key-missing": _doc(lambda doc: doc["entries"]["opt"].update(key="no_such_key")),
    "many-files": _doc(lambda doc: doc["files"].extend(
        {"path": f"f{i}.pt", "size": 1, "checksum": "crc32:00000000", "codec": "none", "format": "pt"}
        for i in range(5_000))),
    "state-key-missing": _edit_state_file(lambda c: c.pop("optimizer_state_dict")),
    "garbage-pickle": lambda d: _replace_data(d, lambda n: craft.zip_replace(n, "data.pkl", b"\x80\x02garbage\x00\xff.")),
    "garbage-file": lambda d: _replace_data(d, lambda n: bytes(range(256)) * 40),
    "zip-huge-sizes": lambda d: _replace_data(d, lambda n: _central_directory(n, _cd_huge_sizes)),
    "zip-overlapping-records": lambda d: _replace_data(d, lambda n: _central_directory(n, _cd_overlapping)),
    "marker-is-directory": lambda d: ((d / layout.COMMIT_MARKER_NAME).unlink(), (d / layout.COMMIT_MARKER_NAME).mkdir()),
}
NOT_COMMITTED = {"marker-is-directory"}
"""Cases that leave no valid marker: the step is not committed, so restore_latest need not warn."""
IN_CONTENT = {"garbage-pickle", "garbage-file", "zip-huge-sizes", "zip-overlapping-records", "state-key-missing",
              "entries-key-missing", "zstd-seek-table"}
"""Cases whose files pass their checksums: only reading them shows the damage (``verify --deep``)."""


def _check_damaged(run: craft.Run, case: str) -> None:
    d = run.step_dir(BAD)
    with pytest.raises(CheckpointError):
        checkpointd.load(str(d))
    code, out = craft.cli("verify", *(["--deep"] if case in IN_CONTENT else []), d)
    assert code != 0, out
    mgr = craft.assert_restores(run, GOOD, warns_about=None if case in NOT_COMMITTED else BAD)
    try:
        assert BAD not in mgr.steps()
    finally:
        mgr.close()


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_step_is_damaged(root: Path, case: str, outside: tuple[Path, Callable[[], None]]) -> None:
    run = craft.save_run(root)
    CASES[case](run.step_dir(BAD))
    _check_damaged(run, case)
    outside[1]()


@pytest.mark.parametrize("case", ["garbage-pickle", "zip-huge-sizes", "zip-overlapping-records", "state-key-missing",
                                  "codec-unknown", "size-float"])
def test_malformed_compressed_step_is_damaged(root: Path, case: str) -> None:
    run = craft.save_run(root, compression="zstd")
    CASES[case](run.step_dir(BAD))
    _check_damaged(run, case)


@pytest.mark.parametrize("compression", [None, "zstd"], ids=["raw", "zstd"])
def test_rng_of_wrong_type_falls_back_with_the_rng_of_the_previous_step(root: Path, compression: str | None) -> None:
    """A training-state file whose RNG entry has the wrong types: nothing half-restored, RNG included."""
    run = craft.save_run(root, compression=compression)
    _edit_state_file(_rng_wrong_type)(run.step_dir(BAD))
    good = craft.step_dir(root, GOOD)
    native = craft.native_bytes(good, craft.data_file(good))
    saved = torch.load(io.BytesIO(native), weights_only=True)["checkpointd_rng"]["torch"]
    craft.assert_restores(run, GOOD).close()
    assert torch.equal(torch.get_rng_state(), saved)


def _seek_table(frames: list[tuple[int, int]]) -> bytes:
    body = b"".join(struct.pack("<II", c, n) for c, n in frames) + struct.pack("<IBI", len(frames), 0, 0x8F92EAB1)
    return struct.pack("<II", 0x184D2A5E, len(body)) + body


def test_zstd_seek_table_claiming_huge_sizes_is_damaged(root: Path) -> None:
    """The seek table says each frame decodes to 4 GiB: nothing may allocate that."""
    run = craft.save_run(root, compression="zstd")
    d = run.step_dir(BAD)
    rel = craft.data_file(d)
    import zstandard

    frame = zstandard.ZstdCompressor(write_checksum=True).compress(b"\0" * 1024)
    stored = frame * 64 + _seek_table([(len(frame), 0xFFFFFFFF)] * 64)
    (d / rel).write_bytes(stored)
    craft.resign(d, rel)
    _check_damaged(run, "zstd-seek-table")


_BOMB_SCRIPT = """
import resource, sys
import checkpointd
from checkpointd.cli import main
def peak(): return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
step_dir, out = sys.argv[1], sys.argv[2]
base = peak()
for name, call in (("load", lambda: checkpointd.load(step_dir)), ("verify", lambda: main(["verify", "--deep", step_dir])),
                   ("export", lambda: main(["export", step_dir, out]))):
    try:
        result = call()
    except checkpointd.CheckpointError as exc:
        result = type(exc).__name__
    print("BOMB", name, type(result).__name__ if not isinstance(result, (int, str)) else result, peak() - base, flush=True)
"""


def test_zstd_decompression_bomb_is_bounded(root: Path, tmp_path: Path) -> None:
    """A 768 MiB run of zeros in a small, correctly signed .zst file whose manifest gives the native
    size of the real file: decoding stops at the listed size; no reader holds the bomb in memory."""
    run = craft.save_run(root, compression="zstd")
    d = run.step_dir(BAD)
    rel = craft.data_file(d)
    listed = json.loads((d / layout.MANIFEST_NAME).read_bytes())["files"]
    raw_size = next(f["raw_size"] for f in listed if f["path"] == rel)
    craft.forge_native(d, rel, bytes(768 << 20), raw_size=raw_size)
    assert (d / rel).stat().st_size < (8 << 20)
    proc = subprocess.run([sys.executable, "-c", _BOMB_SCRIPT, str(d), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("BOMB "):
            _, name, result, grew = line.split()
            results[name] = result
            assert int(grew) < (256 << 20), f"{name} grew the process by {int(grew) >> 20} MiB"
    assert results.get("load") in ("CorruptCheckpointError", "ManifestError"), results
    assert results.get("verify") not in (None, "0") and results.get("export") not in (None, "0"), results
