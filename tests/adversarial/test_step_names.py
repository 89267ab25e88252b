"""Step directory names are ``step-`` and nine or more ASCII digits, nothing else: a copy of a real,
committed step under a look-alike name is not a step for ``steps()``, ``restore_latest``, ``load`` or
``checkpointd ls``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import checkpointd
from checkpointd import CheckpointManager

from . import craft
from .craft import GOOD

LOOKALIKES = {
    "arabic-indic-digit": "step-00000000\u0663",
    "fullwidth-digits": "step-" + "\uff10" * 8 + "\uff13",
    "superscript-digit": "step-00000000\u00b3",
    "too-few-digits": "step-1",
    "trailing-space": "step-000000030 ",
    "leading-space": " step-000000030",
    "trailing-newline": "step-000000030\n",
    "sign": "step-+00000030",
    "negative": "step--00000030",
    "decimal": "step-000000030.5",
    "underscore": "step-000_000_030",
    "upper-case": "STEP-000000030",
    "hundred-digits": "step-" + "9" * 100,
    "suffix": "step-000000030.old",
}


@pytest.mark.parametrize("name", sorted(LOOKALIKES))
def test_lookalike_step_directory_is_not_a_step(root: Path, name: str) -> None:
    run = craft.save_run(root, steps=(GOOD,))
    craft.copy_step(root, GOOD, LOOKALIKES[name])
    with CheckpointManager(str(root), craft.new_state(), compression=None) as mgr:
        assert mgr.steps() == [GOOD]
        assert mgr.latest_step() == GOOD
    craft.assert_restores(run, GOOD, warns_about=None).close()
    assert checkpointd.load(str(root))["progress"] == run.progress[GOOD]
    code, out = craft.cli("ls", "--json", root)
    assert code == 0, out
    assert [row["step"] for row in json.loads(out)["steps"]] == [GOOD]


def test_root_that_is_a_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "not-a-root"
    path.write_bytes(b"just a file")
    with pytest.raises(checkpointd.CheckpointError):
        with CheckpointManager(str(path), craft.new_state(), compression=None) as mgr:
            mgr.save(1)
    assert path.read_bytes() == b"just a file"
    code, out = craft.cli("ls", path)
    assert code != 0, out
    code, out = craft.cli("verify", path)
    assert code != 0, out
    with pytest.raises(checkpointd.CheckpointError):
        checkpointd.load(str(path))
