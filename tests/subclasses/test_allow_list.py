"""Only tensor subclasses that the loading process has imported and accepts are ever rebuilt.

A step holding a class that is not accepted (a test-defined traceable subclass, not allowed) is refused
by a restore and by ``load()`` from the manifest alone, before any pickle runs: no ``torch.load`` is
called, the step stays committed (the caller's set-up is not damage), and the error names the class and
the fix. In a fresh process that has imported neither the class nor torchao, the refusals name what to
import, and nothing is imported on the file's behalf. Saving refuses a class not accepted.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torchao.quantization import Int8Tensor

import checkpointd
from checkpointd import CheckpointManager, StateError, UnacceptedSubclassError, load
from checkpointd.format import subclasses
from tests.subclasses.pair_tensor import PairTensor, pair_module
from tests.subclasses.quantized_models import int8_model

REPO = Path(__file__).resolve().parents[2]
PAIR = r"tests\.subclasses\.pair_tensor\.PairTensor"


@pytest.fixture
def allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    """PairTensor accepted for this test only."""
    monkeypatch.setattr(subclasses, "ALLOWED", dict(subclasses.ALLOWED))
    checkpointd.allow_tensor_subclasses(PairTensor)


def _count_unpickling(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every call of torch's loader (``torch.load`` and checkpointd's in-place loader both go through it)."""
    calls: list[Any] = []
    real = torch.serialization._load

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.serialization, "_load", spy)
    return calls


def test_saving_a_class_not_accepted_is_refused(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, {"model": pair_module(0)}) as mgr:
        with pytest.raises(StateError, match=rf"state\['model'\]\['pair'\] is a tensor subclass {PAIR}, which "
                                             r"checkpointd does not accept; .*allow_tensor_subclasses\(PairTensor\)"):
            mgr.maybe_save(1, force=True)
        assert mgr.steps() == []


def test_allowed_class_restores_in_place_and_is_refused_once_not_allowed(
        tmp_path: Path, allowed: None, monkeypatch: pytest.MonkeyPatch) -> None:
    saved, live = pair_module(0), pair_module(1)
    with CheckpointManager(tmp_path, {"model": saved}, compression=None) as mgr:
        mgr.save(1)
    manifest = json.loads((tmp_path / "step-000000001" / "manifest.json").read_text())
    assert manifest["extra"]["subclasses"] == {"Linear.0.1.pt": {"pair": {
        "class": "tests.subclasses.pair_tensor.PairTensor", "form": "torch",
        "inner": {"a": {"dtype": "float32", "shape": [4, 4]}, "b": {"dtype": "int32", "shape": [4]}}}}}
    pair, ptrs = live.pair, (live.pair.a.data_ptr(), live.pair.b.data_ptr())
    with CheckpointManager(tmp_path, {"model": live}) as mgr:
        assert mgr.restore_latest() == 1
    assert live.pair is pair and (pair.a.data_ptr(), pair.b.data_ptr()) == ptrs
    assert torch.equal(pair.a, saved.pair.a) and torch.equal(pair.b, saved.pair.b) and pair.tag == "pair"
    assert type(load(tmp_path)["model"]["pair"]) is PairTensor

    monkeypatch.setattr(subclasses, "ALLOWED", {})  # imported, but no longer accepted
    calls = _count_unpickling(monkeypatch)
    refused = (rf"step 1 Linear.0.1.pt key 'pair' holds a tensor subclass {PAIR}, which checkpointd does not accept; "
               r"nothing of it was run. To load it, if you trust its code, call "
               r"checkpointd.allow_tensor_subclasses\(PairTensor\)")
    with CheckpointManager(tmp_path, {"model": pair_module(2)}) as mgr:
        with pytest.raises(UnacceptedSubclassError, match=refused):
            mgr.restore_latest()
        with pytest.raises(UnacceptedSubclassError, match=refused):
            mgr.restore(1)
        assert mgr.steps() == [1]  # not taken for damage: still committed
    with pytest.raises(UnacceptedSubclassError, match=rf"key 'pair' holds a tensor subclass {PAIR}"):
        load(tmp_path)
    with pytest.raises(UnacceptedSubclassError, match=rf"key 'pair' holds a tensor subclass {PAIR}"):
        load(tmp_path / "step-000000001" / "Linear.0.1.pt")  # no manifest: refused by class after torch's loader
    assert len(calls) == 1  # only that single file was unpickled; the steps were refused before any pickle ran


_CHILD = textwrap.dedent("""
    import json, sys
    import torch
    from checkpointd import CheckpointManager, UnacceptedSubclassError, load
    out = {}
    for name, root in (("pair", sys.argv[1]), ("int8", sys.argv[2])):
        try:
            load(root)
            out[name + "_load"] = "loaded"
        except UnacceptedSubclassError as exc:
            out[name + "_load"] = str(exc)
        with CheckpointManager(root, {"model": torch.nn.Linear(4, 4)}) as mgr:
            try:
                mgr.restore_latest()
                out[name + "_restore"] = "restored"
            except UnacceptedSubclassError as exc:
                out[name + "_restore"] = str(exc)
            out[name + "_steps"] = mgr.steps()
    out["imported"] = sorted(m for m in sys.modules if m.startswith(("torchao", "tests")))
    print(json.dumps(out))
""")


def test_a_fresh_process_without_the_classes_refuses_and_imports_nothing(tmp_path: Path, allowed: None) -> None:
    with CheckpointManager(tmp_path / "pair", {"model": pair_module(0)}, compression=None) as mgr:
        mgr.save(1)
    with CheckpointManager(tmp_path / "int8", {"model": int8_model(0)}, compression=None) as mgr:
        mgr.save(1)
    assert isinstance(int8_model(0)[0].weight, Int8Tensor)
    done = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / "pair"), str(tmp_path / "int8")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    for how in ("load", "restore"):
        assert "holds a tensor subclass tests.subclasses.pair_tensor.PairTensor, which this process has not imported " \
               "and checkpointd does not accept" in out[f"pair_{how}"]
        assert "import tests.subclasses.pair_tensor and, if you trust its code, call " \
               "checkpointd.allow_tensor_subclasses(PairTensor)" in out[f"pair_{how}"]
        assert "key '0.weight' holds a tensor subclass torchao.quantization.Int8Tensor, which this process has not " \
               "imported; nothing of it was run. To load it, import torchao before loading" in out[f"int8_{how}"]
    assert out["pair_steps"] == [1] and out["int8_steps"] == [1]
    assert out["imported"] == []


def test_the_command_line_exports_torchao_state_with_import_only(tmp_path: Path) -> None:
    """``checkpointd export`` in a fresh process: a step holding torchao's Int8Tensor is refused before any
    pickle is read, naming ``--import``; with ``--import torchao`` it is exported; a module that does not
    import is a usage error."""
    with CheckpointManager(tmp_path / "int8", {"model": int8_model(0)}, compression="zstd") as mgr:
        mgr.save(1)
    step = str(tmp_path / "int8" / "step-000000001")

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "checkpointd", *args], capture_output=True, text=True, timeout=120,
                              cwd=tmp_path)

    refused = cli("export", step, str(tmp_path / "out"))
    assert refused.returncode == 1, refused.stderr[-2000:]
    line = refused.stderr.strip().splitlines()[-1]
    assert "UnacceptedSubclassError" in line and "torchao.quantization.Int8Tensor" in line and "--import MODULE" in line
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    done = cli("export", "--import", "torchao", step, str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr[-2000:]
    exported = torch.load(next((tmp_path / "out").glob("*.pt")), weights_only=True)
    assert any(isinstance(v, Int8Tensor) for v in exported.values()), exported.keys()
    missing = cli("export", "--import", "no_such_module_here", step, str(tmp_path / "out2"))
    assert missing.returncode == 2 and "--import no_such_module_here: No module named" in missing.stderr
