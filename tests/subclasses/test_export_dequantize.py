"""``checkpointd export`` of a step holding tensor subclasses: native files keep them exactly; DCP and
safetensors, which hold plain tensors only, refuse the step unless ``--dequantize`` asks for plain
dequantized tensors (not bit-exact, and said so)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torchao.quantization import Int8Tensor

from checkpointd import CheckpointManager, load
from checkpointd.cli import main
from checkpointd.cli.exits import EXIT_OK, EXIT_USAGE
from tests.subclasses.quantized_models import int8_model


@pytest.fixture
def int8_step(tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    model = int8_model(0)
    with CheckpointManager(tmp_path / "root", {"model": model}, compression="zstd") as mgr:
        mgr.save(4)
    return tmp_path / "root" / "step-000000004", model


@pytest.mark.parametrize("fmt", ["safetensors", "dcp"])
def test_plain_formats_refuse_subclasses_without_dequantize(int8_step, tmp_path: Path, fmt: str,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    step_dir, _ = int8_step
    out = tmp_path / f"out-{fmt}"
    assert main(["export", str(step_dir), str(out), "--format", fmt]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "2 tensor subclass value(s)" in err and "'model/0.weight'" in err and "--dequantize" in err
    assert not out.exists() or not any(out.iterdir())  # nothing written


def test_dequantize_writes_plain_tensors_and_says_they_are_not_exact(int8_step, tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    step_dir, model = int8_step
    want = {k: (v.dequantize() if type(v) is Int8Tensor else v).detach() for k, v in model.state_dict().items()}
    with caplog.at_level(logging.WARNING, logger="checkpointd"):
        assert main(["export", str(step_dir), str(tmp_path / "st"), "--format", "safetensors", "--dequantize"]) == EXIT_OK
        assert main(["export", str(step_dir), str(tmp_path / "dcp"), "--format", "dcp", "--dequantize"]) == EXIT_OK
    assert sum("not bit-exact" in r.getMessage() for r in caplog.records) == 2
    weights = load_file(str(tmp_path / "st" / "model.safetensors"))
    from_dcp = load(tmp_path / "dcp")["model"]
    assert sorted(weights) == sorted(want) == sorted(from_dcp)
    for k, v in want.items():
        assert type(weights[k]) is torch.Tensor and torch.equal(weights[k], v), k
        assert torch.equal(from_dcp[k], v), k


def test_native_export_keeps_subclasses_and_refuses_dequantize(int8_step, tmp_path: Path) -> None:
    step_dir, model = int8_step
    assert main(["export", str(step_dir), str(tmp_path / "n"), "--dequantize"]) == EXIT_USAGE
    assert main(["export", str(step_dir), str(tmp_path / "n")]) == EXIT_OK
    (pt,) = (tmp_path / "n").glob("Sequential.*.pt")
    stored = torch.load(pt, weights_only=True)
    live = model[0].weight
    assert type(stored["0.weight"]) is Int8Tensor
    assert torch.equal(stored["0.weight"].qdata, live.qdata) and torch.equal(stored["0.weight"].scale, live.scale)
