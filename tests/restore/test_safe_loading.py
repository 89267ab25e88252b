"""Safe loading: a checkpoint whose pickle would run code is refused, and runs nothing.

The crafted files sit in committed steps with forged manifests and markers, so they pass every
integrity check: what stops them is the weights-only unpickler on every read path (restore, load,
partial reads, ``inspect``, ``export``, ``verify --deep``).
"""

from __future__ import annotations

import builtins
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import checkpointd
from checkpointd import CheckpointManager, CorruptCheckpointError, UnsafeCheckpointError
from checkpointd.cli import main
from checkpointd.restore.partial import load_tensor
from checkpointd.testing.tamper import CodeRunner, forge_file, malicious_mdlus, malicious_pt
from fake_physicsnemo import FakePNModule

STEP = 5


def _payloads(marker: Path) -> dict[str, CodeRunner]:
    return {
        "os.system": CodeRunner(os.system, f"touch {marker}"),
        "builtins.exec": CodeRunner(builtins.exec, f"open({str(marker)!r}, 'w').write('pwned')"),
        "subprocess": CodeRunner(subprocess.call, ["touch", str(marker)]),
    }


class FakePN(FakePNModule):
    """Duck-typed PhysicsNeMo module, so its file is a .mdlus."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)


def _state() -> dict[str, Any]:
    lin = torch.nn.Linear(3, 2)
    return {"model": lin, "net": FakePN(), "opt": torch.optim.SGD(lin.parameters(), lr=0.1), "extra": {"a": 1}}


@pytest.fixture(params=[None, "zstd"], ids=["raw", "zstd"])
def compression(request: pytest.FixtureRequest) -> str | None:
    return request.param


def _forged_root(tmp_path: Path, compression: str | None, payload: CodeRunner, target: str) -> tuple[Path, Path]:
    """A root with one committed step whose ``target`` file ('pt' or 'mdlus') holds ``payload``."""
    root = tmp_path / "root"
    with CheckpointManager(str(root), _state(), compression=compression) as mgr:
        mgr.save(STEP)
    step_dir = root / "step-000000005"
    suffix = ".zst" if compression else ""
    if target == "pt":
        forge_file(step_dir, f"checkpoint.0.{STEP}.pt{suffix}", malicious_pt(payload))
    else:
        forge_file(step_dir, f"FakePN.0.{STEP}.mdlus{suffix}", malicious_mdlus(payload))
    return root, step_dir


def test_crafted_file_is_live(tmp_path: Path) -> None:
    """Sanity: the crafted file really runs code under an unrestricted torch.load (in a child process)."""
    marker = tmp_path / "marker"
    path = tmp_path / "evil.pt"
    path.write_bytes(malicious_pt(_payloads(marker)["os.system"]))
    code = f"import torch; torch.load({str(path)!r}, weights_only=False)"
    subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, timeout=60)
    assert marker.exists()


@pytest.mark.parametrize("payload", ["os.system", "builtins.exec", "subprocess"])
@pytest.mark.parametrize("target", ["pt", "mdlus"])
def test_every_read_path_refuses(tmp_path: Path, compression: str | None, payload: str, target: str,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    marker = tmp_path / "marker"
    root, step_dir = _forged_root(tmp_path, compression, _payloads(marker)[payload], target)
    pattern = "allow-list|refused"

    # integrity alone passes: the forgery is consistent
    assert main(["verify", str(root)]) == 0

    # an unsafe step is skipped like a damaged one; with no other step, restore_latest raises naming why
    with pytest.warns(RuntimeWarning, match="step 5"), pytest.raises(CorruptCheckpointError, match=pattern):
        CheckpointManager(str(root), _state()).restore_latest()
    with pytest.raises(UnsafeCheckpointError, match=pattern):
        checkpointd.load(str(root))
    key = "opt/param_groups" if target == "pt" else "net/lin.weight"
    with pytest.raises(UnsafeCheckpointError, match=pattern):
        load_tensor(str(root), key)

    capsys.readouterr()
    assert main(["inspect", str(step_dir)]) == 1
    assert "UnsafeCheckpointError" in capsys.readouterr().err
    out_dir = tmp_path / "out"
    assert main(["export", str(step_dir), str(out_dir)]) == 1
    assert "UnsafeCheckpointError" in capsys.readouterr().err
    assert not out_dir.exists() or not any(p.name.startswith(("checkpoint", "FakePN")) for p in out_dir.iterdir())
    assert main(["verify", "--deep", str(root)]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "step 5" in out and "allow-list" in out

    assert not marker.exists(), "a crafted checkpoint ran code"


def test_single_file_load_refuses(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    path = tmp_path / "evil.0.1.pt"
    path.write_bytes(malicious_pt(_payloads(marker)["builtins.exec"]))
    with pytest.raises(UnsafeCheckpointError, match=r"builtin\w*\.exec"):
        load_tensor(str(path), "weight")
    with pytest.raises(UnsafeCheckpointError):
        checkpointd.load(str(path))
    assert main(["inspect", str(path)]) == 1
    assert not marker.exists()


def test_garbage_pickle_is_corrupt_not_unsafe(tmp_path: Path) -> None:
    """A data.pkl that is no pickle at all is reported as damage, not as an attack."""
    import io
    import zipfile

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("archive/data.pkl", b"\x80\x02garbage that is not a pickle")
        zf.writestr("archive/version", b"3\n")
    path = tmp_path / "bad.pt"
    path.write_bytes(buf.getvalue())
    with pytest.raises(checkpointd.CheckpointError) as info:
        load_tensor(str(path), "weight")
    assert not isinstance(info.value, UnsafeCheckpointError)
