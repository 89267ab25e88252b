"""Commit markers an attacker wrote: a step counts only if its ``COMMITTED`` marker names that step and
matches the SHA-256 of the manifest beside it. Anything else is not a checkpoint: it is not listed,
not restored, and never makes retention delete real saves."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from checkpointd import CheckpointManager
from checkpointd.format import layout

from . import craft
from .craft import BAD, GOOD

STRAY = 99
"""A step directory newer than every real save, holding an invalid marker."""


def _marker(d: Path) -> Path:
    return d / layout.COMMIT_MARKER_NAME


def _manifest_sha(d: Path) -> str:
    return "sha256:" + hashlib.sha256((d / layout.MANIFEST_NAME).read_bytes()).hexdigest()


def _garbage(d: Path) -> None:
    _marker(d).write_bytes(b"garbage \xff\x00 not a marker")


def _json_list(d: Path) -> None:
    _marker(d).write_text(json.dumps([_manifest_sha(d)]))


def _empty_object(d: Path) -> None:
    _marker(d).write_text("{}")


def _checksum_wrong(d: Path) -> None:
    _marker(d).write_text(json.dumps({"manifest": layout.MANIFEST_NAME, "manifest_checksum": "sha256:" + "0" * 64,
                                      "step": layout.parse_step_dir_name(d.name)}))


def _checksum_wrong_type(d: Path) -> None:
    _marker(d).write_text(json.dumps({"manifest": layout.MANIFEST_NAME, "manifest_checksum": 12345,
                                      "step": layout.parse_step_dir_name(d.name)}))


def _copied_from_other_step(d: Path) -> None:
    shutil.copyfile(_marker(craft.step_dir(d.parent, GOOD)), _marker(d))


def _names_another_step(d: Path) -> None:
    """Right checksum, but the marker names another step."""
    _marker(d).write_text(json.dumps({"manifest": layout.MANIFEST_NAME, "manifest_checksum": _manifest_sha(d),
                                      "step": layout.parse_step_dir_name(d.name) + 1}))


def _names_no_step(d: Path) -> None:
    _marker(d).write_text(json.dumps({"manifest": layout.MANIFEST_NAME, "manifest_checksum": _manifest_sha(d)}))


def _names_another_manifest(d: Path) -> None:
    """The marker names (and matches) a different manifest file; manifest.json does not match it."""
    other = d / "other.json"
    doc = json.loads((d / layout.MANIFEST_NAME).read_bytes())
    doc["metrics"] = {"forged": 1.0}
    other.write_text(json.dumps(doc))
    _marker(d).write_text(json.dumps({"manifest": "other.json",
                                      "manifest_checksum": "sha256:" + hashlib.sha256(other.read_bytes()).hexdigest(),
                                      "step": layout.parse_step_dir_name(d.name)}))


def _names_manifest_outside(d: Path) -> None:
    """The marker points at a manifest outside the step directory (that of the good step)."""
    good = craft.step_dir(d.parent, GOOD) / layout.MANIFEST_NAME
    _marker(d).write_text(json.dumps({"manifest": f"../{good.parent.name}/{layout.MANIFEST_NAME}",
                                      "manifest_checksum": "sha256:" + hashlib.sha256(good.read_bytes()).hexdigest(),
                                      "step": layout.parse_step_dir_name(d.name)}))


def _manifest_and_marker_copied(d: Path) -> None:
    """Manifest and marker of another step copied in: the marker matches, but names the other step."""
    src = craft.step_dir(d.parent, GOOD)
    for name in (layout.MANIFEST_NAME, layout.COMMIT_MARKER_NAME):
        shutil.copyfile(src / name, d / name)


def _manifest_altered(d: Path) -> None:
    doc = json.loads((d / layout.MANIFEST_NAME).read_bytes())
    doc["metrics"] = {"loss": 0.0}
    (d / layout.MANIFEST_NAME).write_text(json.dumps(doc))


MARKERS: dict[str, Callable[[Path], None]] = {
    "garbage": _garbage, "json-list": _json_list, "empty-object": _empty_object,
    "checksum-wrong": _checksum_wrong, "checksum-wrong-type": _checksum_wrong_type,
    "copied-from-other-step": _copied_from_other_step, "names-another-step": _names_another_step,
    "names-no-step": _names_no_step, "names-another-manifest": _names_another_manifest,
    "names-manifest-outside": _names_manifest_outside, "manifest-and-marker-copied": _manifest_and_marker_copied,
    "manifest-altered": _manifest_altered,
}


@pytest.mark.parametrize("attack", sorted(MARKERS))
def test_invalid_marker_is_not_committed(root: Path, attack: str, outside: tuple[Path, Callable[[], None]]) -> None:
    run = craft.save_run(root)
    MARKERS[attack](run.step_dir(BAD))
    with CheckpointManager(str(root), craft.new_state(), compression=None) as mgr:
        assert mgr.steps() == [GOOD]
        assert mgr.latest_step() == GOOD
    mgr = craft.assert_restores(run, GOOD, warns_about=None)
    mgr.close()
    code, out = craft.cli("verify", root)
    assert code == 0, f"verify of the root checks only committed steps, and step {GOOD} verifies: {out}"
    code, out = craft.cli("verify", run.step_dir(BAD))
    assert code != 0, out
    outside[1]()


@pytest.mark.parametrize("attack", sorted(MARKERS))
def test_stray_directory_never_makes_retention_delete_real_saves(root: Path, attack: str) -> None:
    """A newer step directory with an invalid marker: keep_last=1 must keep the newest real save."""
    run = craft.save_run(root, steps=(GOOD,))
    stray = craft.copy_step(root, GOOD, layout.step_dir_name(STRAY))
    craft.edit_manifest(stray, lambda doc: doc.update(step=STRAY), sign=True)
    MARKERS[attack](stray)
    state = craft.new_state(seed=2)
    with CheckpointManager(str(root), state, compression=None, keep_last=1) as mgr:
        assert mgr.restore_latest() == GOOD
        for step in (GOOD + 1, GOOD + 2):
            craft.advance(state, step)
            mgr.save(step)
            mgr.wait()
            assert mgr.steps() == [step], f"after saving step {step}: {mgr.steps()}"
        expected = craft.state_values(state)
    fresh = craft.new_state(seed=3)
    with CheckpointManager(str(root), fresh, compression=None) as mgr:
        assert mgr.restore_latest() == GOOD + 2
        craft.assert_values(fresh, expected)
    _ = run


def test_marker_that_is_a_directory_is_not_a_checkpoint(root: Path) -> None:
    run = craft.save_run(root)
    _marker(run.step_dir(BAD)).unlink()
    _marker(run.step_dir(BAD)).mkdir()
    with CheckpointManager(str(root), craft.new_state(), compression=None) as mgr:
        assert mgr.steps() == [GOOD]
    craft.assert_restores(run, GOOD, warns_about=None).close()
    code, out = craft.cli("ls", root)
    assert code == 0, out
    code, out = craft.cli("verify", run.step_dir(BAD))
    assert code != 0, out


def test_empty_marker_is_not_a_checkpoint(root: Path) -> None:
    run = craft.save_run(root)
    _marker(run.step_dir(BAD)).write_bytes(b"")
    with CheckpointManager(str(root), craft.new_state(), compression=None) as mgr:
        assert mgr.steps() == [GOOD]
    craft.assert_restores(run, GOOD, warns_about=None).close()
    code, out = craft.cli("verify", run.step_dir(BAD))
    assert code != 0, out
