"""torchao's quantized tensors saved and restored bit-exactly, in place, on CPU.

Int8 weight-only (``Int8Tensor``), Float8 weight-only on bf16 (``Float8Tensor``), QLoRA (frozen
``NF4Tensor`` bases, LoRA adapters trained with AdamW) and float8 training with the FSDP float8
all-gather wrapper (``WeightWithDynamicFloat8CastTensor``, AdamW): a fresh model restored from a step
holds the saved classes, flatten contexts and bytes, its parameter objects and inner storages are the
ones it had, and training on continues bit-exactly. The uncompressed ``.pt``/``.mdlus`` files are what
``torch.save`` writes: ``torch.load(weights_only=True)`` reads the subclasses back.
"""

from __future__ import annotations

import logging
import zipfile
from pathlib import Path
from typing import Callable

import pytest
import torch
from torch import nn
from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

from checkpointd import CheckpointManager, StateMismatchError, StagingOptions
from checkpointd.restore import apply as restore_apply
from checkpointd.save import snapshot
from tests.fake_physicsnemo import FakePNModule
from tests.subclasses.quantized_models import (assert_bit_equal, float8_model, float8_training_model,
                                               int8_model, optimizer_bits, qlora_model, restore_in_place, train_steps)

MODELS: dict[str, tuple[Callable[[int], nn.Module], int, torch.dtype, bool]] = {
    # name: (builder, input features, input dtype, trained)
    "int8-weight-only": (int8_model, 64, torch.float32, False),
    "float8-weight-only": (float8_model, 64, torch.bfloat16, False),
    "qlora-nf4": (qlora_model, 256, torch.bfloat16, True),
    "float8-training": (float8_training_model, 64, torch.float32, True),
}


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad] or [nn.Parameter(torch.zeros(1))]
    return torch.optim.AdamW(params, lr=1e-2)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_restore_is_bit_exact_in_place_and_training_continues(tmp_path: Path, name: str) -> None:
    build, features, dtype, trained = MODELS[name]
    saved, fresh = build(0), build(1)
    opt_saved, opt_fresh = _optimizer(saved), _optimizer(fresh)
    if trained:
        train_steps(saved, opt_saved, range(3), features, dtype)
    restore_in_place(tmp_path / "ckpt", saved, opt_saved, fresh, opt_fresh, 3, compression=None)
    # the module file is what torch.save writes: a weights-only torch.load reads the subclasses back
    (model_file,) = (tmp_path / "ckpt" / "step-000000003").glob("Sequential.0.3.pt")
    assert_bit_equal(saved.state_dict(), torch.load(model_file, weights_only=True))
    if trained:
        train_steps(saved, opt_saved, range(3, 5), features, dtype)
        train_steps(fresh, opt_fresh, range(3, 5), features, dtype)
        assert_bit_equal(saved.state_dict(), fresh.state_dict())
        assert_bit_equal(optimizer_bits(opt_saved), optimizer_bits(opt_fresh))


def test_device_staging_and_zstd_paths_restore_bit_exactly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inner tensors take the host budget's chunk ring at save and the placement path at restore."""
    monkeypatch.setattr(snapshot, "STREAM_CPU_TENSORS", True)
    monkeypatch.setattr(restore_apply, "PLACE_ON_CPU", True)
    saved, fresh = qlora_model(0), qlora_model(1)
    opt_saved, opt_fresh = _optimizer(saved), _optimizer(fresh)
    train_steps(saved, opt_saved, range(2), 256, torch.bfloat16)
    staging = StagingOptions(host_budget_bytes=1 << 20)
    restore_in_place(tmp_path, saved, opt_saved, fresh, opt_fresh, 2, compression="zstd", staging=staging)


class QuantNet(FakePNModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 32)


def test_mdlus_model_pt_reads_back_with_weights_only_torch_load(tmp_path: Path) -> None:
    net = QuantNet()
    quantize_(net, Int8DynamicActivationInt8WeightConfig())  # its flatten context holds torchao dataclasses and enums
    with CheckpointManager(tmp_path, {"model": net}, compression=None) as mgr:
        mgr.save(1)
    (mdlus,) = (tmp_path / "step-000000001").glob("QuantNet.0.1.mdlus")
    with zipfile.ZipFile(mdlus) as zf, zf.open("model.pt") as f:
        got = torch.load(f, weights_only=True)
    assert_bit_equal(net.state_dict(), got)
    assert type(got["lin.weight"]).__name__ == "Int8Tensor"


def test_changed_quantization_config_rebuilds_and_says_so(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    saved, live = int8_model(0), nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8))
    quantize_(live, Int8DynamicActivationInt8WeightConfig())  # another flatten context: no copy in place
    with CheckpointManager(tmp_path, {"model": saved}, compression=None) as mgr:
        mgr.save(1)
    weight = live[0].weight
    with caplog.at_level(logging.INFO, logger="checkpointd"):
        with CheckpointManager(tmp_path, {"model": live}) as mgr:
            mgr.restore(1)
    assert live[0].weight is weight and isinstance(weight, nn.Parameter)  # the same Python object, swapped
    assert weight.__tensor_flatten__()[1] == saved[0].weight.__tensor_flatten__()[1]
    assert_bit_equal(saved.state_dict(), live.state_dict())
    assert any("key '0.weight': rebuilt Int8Tensor" in r.getMessage() and "not restored in place" in r.getMessage()
               for r in caplog.records)


def test_a_plain_model_does_not_take_a_quantized_step(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, {"model": int8_model(0)}, compression=None) as mgr:
        mgr.save(1)
    plain = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8))
    want = {k: v.clone() for k, v in plain.state_dict().items()}
    with CheckpointManager(tmp_path, {"model": plain}) as mgr:
        with pytest.raises(StateMismatchError, match=r"key '0.weight': the live tensor is a plain tensor, step 1 holds "
                                                     r"torchao.quantization.Int8Tensor"):
            mgr.restore(1)
        assert mgr.steps() == [1]
    assert all(torch.equal(want[k], v) for k, v in plain.state_dict().items())
