"""Manifest paths are untrusted: a data file listed as ``../x``, an absolute path, a backslash path,
an empty path, the manifest or marker themselves, or the same file twice makes the step damaged. No
reader follows such a path out of the step directory, and ``export`` writes nothing outside OUT.

Where a path leads outside, a valid-looking decoy with a matching checksum waits there: a loader that
followed the path would return the decoy's values (all 7.0).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import checkpointd
from checkpointd import CheckpointError
from checkpointd.codecs.checksum import checksum_bytes

from . import craft
from .craft import BAD, GOOD

DECOY = craft.torch_save_bytes(OrderedDict(weight=torch.full((4, 4), 7.0), bias=torch.full((4,), 7.0)))


def _point_model_at(d: Path, path: str, target: Path | None) -> None:
    """List the model's file as ``path``; with ``target``, size and checksum are those of that file."""
    real = craft.model_file(d)
    data = target.read_bytes() if target is not None else (d / real).read_bytes()

    def change(doc: dict[str, Any]) -> None:
        for f in doc["files"]:
            if f["path"] == real:
                f.update(path=path, size=len(data), checksum=checksum_bytes(data), raw_size=len(data), codec="none")
        doc["entries"]["model"]["file"] = path

    craft.edit_manifest(d, change)


def _decoy(at: Path) -> Path:
    at.parent.mkdir(parents=True, exist_ok=True)
    at.write_bytes(DECOY)
    return at


def _in_root(d: Path, tmp: Path, out: Path) -> None:
    _point_model_at(d, "../decoy.pt", _decoy(d.parent / "decoy.pt"))


def _beside_root(d: Path, tmp: Path, out: Path) -> None:
    _point_model_at(d, "../../decoy/model.pt", _decoy(tmp / "decoy" / "model.pt"))


def _outside_fixture(d: Path, tmp: Path, out: Path) -> None:
    _point_model_at(d, "../../outside/precious.bin", out / "precious.bin")


def _absolute(d: Path, tmp: Path, out: Path) -> None:
    _point_model_at(d, str(_decoy(tmp / "decoy" / "abs.pt")), tmp / "decoy" / "abs.pt")


def _through_subdir(d: Path, tmp: Path, out: Path) -> None:
    _point_model_at(d, "shards/../../decoy.pt", _decoy(d.parent / "decoy.pt"))


def _backslashes(d: Path, tmp: Path, out: Path) -> None:
    name = "a\\..\\b"
    (d / name).write_bytes(DECOY)
    _point_model_at(d, name, d / name)


def _empty(d: Path, tmp: Path, out: Path) -> None:
    _point_model_at(d, "", None)


def _dot(d: Path, tmp: Path, out: Path) -> None:
    _point_model_at(d, ".", None)


def _subdirectory(d: Path, tmp: Path, out: Path) -> None:
    (d / "sub").mkdir()
    _point_model_at(d, "sub", None)


def _the_manifest(d: Path, tmp: Path, out: Path) -> None:
    _point_model_at(d, "manifest.json", None)


def _the_marker(d: Path, tmp: Path, out: Path) -> None:
    _point_model_at(d, "COMMITTED", None)


def _nul(d: Path, tmp: Path, out: Path) -> None:
    _point_model_at(d, craft.model_file(d) + "\x00.pt", None)


def _listed_twice(d: Path, tmp: Path, out: Path) -> None:
    craft.edit_manifest(d, lambda doc: doc["files"].append(dict(doc["files"][0])))


def _entry_outside_files(d: Path, tmp: Path, out: Path) -> None:
    """The entries map names a decoy outside that ``files`` does not list."""
    _decoy(tmp / "decoy" / "model.pt")
    craft.edit_manifest(d, lambda doc: doc["entries"]["model"].update(file="../../decoy/model.pt"))


PATHS: dict[str, Callable[[Path, Path, Path], None]] = {
    "dotdot-in-root": _in_root, "dotdot-beside-root": _beside_root, "dotdot-outside": _outside_fixture,
    "absolute": _absolute, "through-subdir": _through_subdir, "backslashes": _backslashes, "empty": _empty,
    "dot": _dot, "subdirectory": _subdirectory, "the-manifest": _the_manifest, "the-marker": _the_marker,
    "nul": _nul, "listed-twice": _listed_twice, "entry-outside-files": _entry_outside_files,
}


def _not_decoy(values: Any) -> None:
    weight = values.get("model", {}).get("weight") if isinstance(values, dict) else None
    assert weight is None or not torch.equal(weight, torch.full((4, 4), 7.0)), "the decoy outside the step got loaded"


@pytest.mark.parametrize("attack", sorted(PATHS))
def test_untrusted_path_makes_the_step_damaged(tmp_path: Path, root: Path, attack: str,
                                               outside: tuple[Path, Callable[[], None]]) -> None:
    top, check = outside
    run = craft.save_run(root)
    d = run.step_dir(BAD)
    PATHS[attack](d, tmp_path, top)

    with pytest.raises(CheckpointError) as info:
        _not_decoy(checkpointd.load(str(d)))
    assert not isinstance(info.value, AssertionError)
    code, text = craft.cli("verify", root)
    assert code != 0 and str(BAD) in text, text

    export = tmp_path / "export"
    before = craft.tree_state(tmp_path, skip="export")
    code, text = craft.cli("export", d, export)
    assert code != 0, f"export of a step with path {attack!r} succeeded: {text}"
    assert craft.tree_state(tmp_path, skip="export") == before, "export wrote or removed files outside OUT"
    check()

    craft.assert_restores(run, GOOD).close()
    check()
