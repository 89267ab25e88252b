"""Quantized state (torchao tensor subclasses) saved by checkpointd, DCP and torch.save, side by side.

States, each a stack of ``--layers`` square linear layers of width ``--width``:

- ``int8``: ``quantize_(Int8WeightOnlyConfig())`` (``Int8Tensor`` weights: int8 codes, fp32 row scales);
- ``float8``: bf16 layers under ``Float8WeightOnlyConfig()`` (``Float8Tensor``: float8_e4m3 codes, scales);
- ``qlora``: frozen ``NF4Tensor`` bases (bf16 originals) with trained LoRA adapters and their AdamW state;
- ``adamw8bit``: fp32 layers with torchao's ``AdamW8bit`` state (``OptimState8bit`` moments).

Methods: ``checkpointd`` (``CheckpointManager(..., compression=None)``: ``maybe_save`` returns at once,
the commit follows in the background), ``checkpointd_plain`` (the same save of a dict holding the same
inner tensors as plain tensors: beside ``checkpointd``, what walking the subclasses costs the call), ``dcp_async`` (``torch.distributed.checkpoint.async_save``),
``dcp`` (``torch.distributed.checkpoint.save``, blocking) and ``torch_save``. For each, the second of two saves (the first allocates): the blocking call's time, the time until the
checkpoint is complete, bytes on disk, then a restore into a fresh object of the same kind and whether every stored byte (subclass inner
tensors included) came back exactly, and the state's class. Absolute times only count on a GPU host
(``--device cuda``); on CPU compare the methods with each other.

Usage::

    python benchmarks/bench_quantized.py [--device cpu|cuda] [--width 1024] [--layers 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
warnings.filterwarnings("ignore", message=".*KernelPreference.*")

import torch.distributed.checkpoint as dcp  # noqa: E402
from torchao.optim import AdamW8bit  # noqa: E402
from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig, quantize_  # noqa: E402
from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4, to_nf4  # noqa: E402

from checkpointd import CheckpointManager  # noqa: E402

State = tuple[nn.Module, torch.optim.Optimizer | None]


class LoRA(nn.Module):
    def __init__(self, width: int, rank: int = 16) -> None:
        super().__init__()
        self.weight = nn.Parameter(to_nf4(torch.randn(width, width, dtype=torch.bfloat16) * 0.02), requires_grad=False)
        self.lora_a = nn.Parameter(torch.randn(rank, width, dtype=torch.bfloat16) * 0.01)
        self.lora_b = nn.Parameter(torch.zeros(width, rank, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_nf4(x, self.weight) + (x @ self.lora_a.t()) @ self.lora_b.t()


def _stack(width: int, layers: int, dtype: torch.dtype = torch.float32) -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(width, width, dtype=dtype) for _ in range(layers)])


def _train(model: nn.Module, opt: torch.optim.Optimizer, width: int, dtype: torch.dtype, device: str) -> None:
    for step in range(2):
        x = torch.randn(8, width, generator=torch.Generator().manual_seed(step)).to(device=device, dtype=dtype)
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def make_state(kind: str, seed: int, width: int, layers: int, device: str) -> State:
    torch.manual_seed(seed)
    if kind == "int8":
        model = _stack(width, layers).to(device)
        quantize_(model, Int8WeightOnlyConfig())
        return model, None
    if kind == "float8":
        model = _stack(width, layers, torch.bfloat16).to(device)
        quantize_(model, Float8WeightOnlyConfig())
        return model, None
    if kind == "qlora":
        model = nn.Sequential(*[LoRA(width) for _ in range(layers)]).to(device)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        _train(model, opt, width, torch.bfloat16, device)
        return model, opt
    if kind == "adamw8bit":
        model = _stack(width, layers).to(device)
        opt = AdamW8bit(model.parameters(), lr=1e-3)
        _train(model, opt, width, torch.float32, device)
        return model, opt
    raise ValueError(kind)


def stored_bytes(obj: Any) -> dict[str, torch.Tensor]:
    """Every tensor's bytes by path (on the host), a subclass's inner tensors each on their own."""
    return {k: v.contiguous().reshape(-1).view(torch.uint8).cpu() for k, v in inner_tensors(obj).items()}


def snapshot(state: State) -> dict[str, Any]:
    model, opt = state
    return {"model": model.state_dict(), "optim": opt.state_dict() if opt is not None else {}}


def same_bytes(a: State, b: State) -> bool:
    x, y = stored_bytes(snapshot(a)), stored_bytes(snapshot(b))
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def disk_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def run_checkpointd(saved: State, fresh: State, d: str) -> dict[str, Any]:
    model, opt = saved
    state = {"model": model, **({"optim": opt} if opt is not None else {})}
    fresh_state = {"model": fresh[0], **({"optim": fresh[1]} if fresh[1] is not None else {})}
    return _timed_checkpointd(d, state, fresh_state)


def _timed_checkpointd(d: str, state: dict[str, Any], fresh_state: dict[str, Any]) -> dict[str, Any]:
    """The second of two saves of ``state`` (timed), then a restore into ``fresh_state`` by a new manager."""
    with CheckpointManager(d, state, compression=None, keep_last=1) as mgr:
        mgr.save(1)  # the first save allocates the staging memory: time the second, as a training run's
        mgr.wait()
        t0 = time.perf_counter()
        mgr.maybe_save(2, force=True)
        call = time.perf_counter() - t0
        mgr.wait()
        done = time.perf_counter() - t0
    t0 = time.perf_counter()
    with CheckpointManager(d, fresh_state) as mgr:
        mgr.restore_latest()
    return {"call_s": call, "complete_s": done, "restore_s": time.perf_counter() - t0}


def inner_tensors(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor by path, a subclass's inner tensors each on their own (plain tensors, same device)."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(obj, torch.Tensor):
        if type(obj) in (torch.Tensor, nn.Parameter):
            out[prefix] = obj.detach()
        else:
            for name in obj.__tensor_flatten__()[0]:
                out.update(inner_tensors(getattr(obj, name), f"{prefix}.{name}"))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(inner_tensors(v, f"{prefix}/{k}"))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(inner_tensors(v, f"{prefix}/{i}"))
    return out


def run_checkpointd_plain(saved: State, fresh: State, d: str) -> dict[str, Any]:
    """The checkpointd save of the same bytes as plain tensors; the restore fills ``fresh``'s twin."""
    plain = {k: v.clone() for k, v in inner_tensors(snapshot(saved)).items()}
    twin = {k: torch.zeros_like(v) for k, v in plain.items()}
    res = _timed_checkpointd(d, {"plain": plain}, {"plain": twin})
    if not all(torch.equal(twin[k], plain[k]) for k in plain):
        raise AssertionError("plain twin restored with different bytes")
    for dst, src in zip(inner_tensors(snapshot(fresh)).values(), plain.values()):  # so the row's check holds
        dst.copy_(src)
    return res


def run_dcp_async(saved: State, fresh: State, d: str) -> dict[str, Any]:
    dcp.async_save(snapshot(saved), checkpoint_id=d).result()  # warm-up, as for checkpointd
    t0 = time.perf_counter()
    future = dcp.async_save(snapshot(saved), checkpoint_id=d)
    call = time.perf_counter() - t0
    future.result()
    return _dcp_load(fresh, d, call, time.perf_counter() - t0)


def run_dcp(saved: State, fresh: State, d: str) -> dict[str, Any]:
    dcp.save(snapshot(saved), checkpoint_id=d)
    t0 = time.perf_counter()
    dcp.save(snapshot(saved), checkpoint_id=d)
    call = time.perf_counter() - t0
    return _dcp_load(fresh, d, call, call)


def _dcp_load(fresh: State, d: str, call: float, done: float) -> dict[str, Any]:
    t0 = time.perf_counter()
    target = snapshot(fresh)
    dcp.load(target, checkpoint_id=d)
    fresh[0].load_state_dict(target["model"])
    if fresh[1] is not None:
        fresh[1].load_state_dict(target["optim"])
    return {"call_s": call, "complete_s": done, "restore_s": time.perf_counter() - t0}


def run_torch_save(saved: State, fresh: State, d: str) -> dict[str, Any]:
    path = os.path.join(d, "ckpt.pt")
    torch.save(snapshot(saved), path)
    t0 = time.perf_counter()
    torch.save(snapshot(saved), path)
    call = time.perf_counter() - t0
    t0 = time.perf_counter()
    loaded = torch.load(path, weights_only=True, map_location=next(fresh[0].parameters()).device)
    fresh[0].load_state_dict(loaded["model"])
    if fresh[1] is not None:
        fresh[1].load_state_dict(loaded["optim"])
    return {"call_s": call, "complete_s": call, "restore_s": time.perf_counter() - t0}


METHODS: dict[str, Callable[[State, State, str], dict[str, Any]]] = {
    "checkpointd": run_checkpointd, "checkpointd_plain": run_checkpointd_plain, "dcp_async": run_dcp_async, "dcp": run_dcp, "torch_save": run_torch_save}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--kinds", default="int8,float8,qlora,adamw8bit")
    parser.add_argument("--dir", default=None, help="where checkpoints go (a temporary directory by default)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    root = tempfile.mkdtemp(dir=args.dir)
    rows = []
    lines = [f"== quantized state: torch {torch.__version__}, device {args.device}, {os.cpu_count()} cores, "
             f"width {args.width} x {args.layers} layers",
             f"{'state':10} {'method':17} {'MB':>8} {'call ms':>9} {'complete ms':>11} {'restore ms':>10}  bit-exact  class"]
    print("\n".join(lines))
    for kind in args.kinds.split(","):
        for method, run in METHODS.items():
            saved = make_state(kind, 0, args.width, args.layers, args.device)
            fresh = make_state(kind, 1, args.width, args.layers, args.device)
            d = os.path.join(root, f"{kind}-{method}")
            os.makedirs(d)
            try:
                res = run(saved, fresh, d)
                exact = same_bytes(saved, fresh)
                classes = sorted({type(v).__name__ for v in snapshot(fresh)["model"].values()} - {"Tensor", "Parameter"})
                row = {"state": kind, "method": method, "bytes": disk_bytes(d), "bit_exact": exact,
                       "classes": classes, **res}
                line = (f"{kind:10} {method:17} {row['bytes'] / 1e6:8.1f} {1e3 * res['call_s']:9.1f} "
                        f"{1e3 * res['complete_s']:11.1f} {1e3 * res['restore_s']:10.1f}  {str(exact):9}  "
                        f"{','.join(classes) or '-'}")
            except Exception as exc:  # a method that cannot take this state says why in its row
                row = {"state": kind, "method": method, "error": f"{type(exc).__name__}: {exc}"[:300]}
                line = f"{kind:10} {method:17} failed: {row['error'][:150]}"
            rows.append(row)
            lines.append(line)
            print(line)
            shutil.rmtree(d, ignore_errors=True)
    shutil.rmtree(root, ignore_errors=True)
    if args.json:
        info = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__,
                "cpu_count": os.cpu_count(), "date": time.strftime("%Y-%m-%d"), "command": "python " + " ".join(sys.argv)}
        args.json.write_text(json.dumps({"info": info, "rows": rows, "table": "\n".join(lines)}, indent=2))


if __name__ == "__main__":
    main()
