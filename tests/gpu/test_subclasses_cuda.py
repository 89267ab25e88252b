"""torchao's quantized tensors on a CUDA device: saved from pinned or device staging, restored in place, bit-exact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
pytest.importorskip("torchao")

from torch import nn  # noqa: E402

from checkpointd import StagingOptions  # noqa: E402
from tests.subclasses.quantized_models import float8_model, int8_model, qlora_model, restore_in_place  # noqa: E402

MODELS = {"int8-weight-only": (int8_model, 64, torch.float32, False),
          "float8-weight-only": (float8_model, 64, torch.bfloat16, False),
          "qlora-nf4": (qlora_model, 256, torch.bfloat16, True)}


@pytest.mark.parametrize("staging", ["pinned", "device"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_cuda_subclasses_restore_in_place_bit_exactly(tmp_path: Path, name: str, staging: str) -> None:
    build, features, dtype, trained = MODELS[name]
    saved, fresh = build(0).cuda(), build(1).cuda()
    params = lambda m: [p for p in m.parameters() if p.requires_grad] or [nn.Parameter(torch.zeros(1, device="cuda"))]
    opt_saved, opt_fresh = torch.optim.AdamW(params(saved), lr=1e-2), torch.optim.AdamW(params(fresh), lr=1e-2)
    if trained:
        for step in range(2):
            torch.manual_seed(step)
            saved(torch.randn(4, features, dtype=dtype, device="cuda")).float().pow(2).mean().backward()
            opt_saved.step()
            opt_saved.zero_grad()
    assert any(p.is_cuda and type(p) not in (torch.Tensor, nn.Parameter) for p in saved.parameters())
    kw = {"staging": StagingOptions(device_budget_bytes=1 << 28)} if staging == "device" else {}
    restore_in_place(tmp_path, saved, opt_saved, fresh, opt_fresh, 2, compression=None, **kw)
