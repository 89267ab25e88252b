"""``load()`` gives the saved tensor subclasses by default, plain dequantized tensors on request.

``dequantize=True`` turns every quantized tensor into a plain tensor with its class's own math and
warns that those values are not bit-exact; the float8 training wrapper's value is its high-precision
master weight. A class with no rule is refused with the function to register.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torchao.quantization import Int8Tensor, NF4Tensor

import checkpointd
from checkpointd import CheckpointManager, ConfigError, load
from checkpointd.format import dequantize as dequantize_rules
from tests.subclasses.quantized_models import float8_training_model, int8_model, qlora_model


def test_load_returns_subclasses_or_dequantized_plain_tensors(tmp_path: Path) -> None:
    int8, qlora, f8 = int8_model(0), qlora_model(0), float8_training_model(0)
    with CheckpointManager(tmp_path, {"int8": int8, "qlora": qlora, "f8": f8}, compression="zstd") as mgr:
        mgr.save(1)
    exact = load(tmp_path)
    assert type(exact["int8"]["0.weight"]) is Int8Tensor and type(exact["qlora"]["1.weight"]) is NF4Tensor
    with pytest.warns(UserWarning, match=r"gave 6 tensor subclass value\(s\) as plain dequantized tensors, which are "
                                         r"not bit-exact copies of the saved values: 'int8/0.weight' \(Int8Tensor\)"):
        plain = load(tmp_path, dequantize=True)
    for name, want in (("int8", int8[0].weight.dequantize()), ("qlora", qlora[0].weight.get_original_weight()),
                       ("f8", f8[0].weight._tensor)):
        got = plain[name]["0.weight"]
        assert type(got) is torch.Tensor and got.dtype == want.dtype and torch.equal(got, want.detach())
    assert torch.equal(plain["int8"]["0.bias"], int8[0].bias.detach())  # plain values stay as they are
    assert not [t for t in (plain["int8"], plain["qlora"], plain["f8"]) for v in t.values() if type(v) is not torch.Tensor]


def test_a_class_without_a_rule_is_refused_naming_the_registration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dequantize_rules, "DEQUANTIZERS", {})
    with CheckpointManager(tmp_path, {"qlora": qlora_model(0)}, compression=None) as mgr:
        mgr.save(1)
    with pytest.raises(ConfigError, match=r"key 'qlora/0.weight' holds a torchao.quantization.quantize_.workflows.nf4"
                                          r".nf4_tensor.NF4Tensor, which checkpointd cannot dequantize .*register_dequantizer"):
        load(tmp_path, dequantize=True)
    checkpointd.register_dequantizer(NF4Tensor, lambda t: t.get_original_weight())
    with pytest.warns(UserWarning, match="not bit-exact"):
        assert type(load(tmp_path, dequantize=True)["qlora"]["0.weight"]) is torch.Tensor
