"""Run inside the PhysicsNeMo venv by tests/test_physicsnemo_interop.py; one call does a batch of checks.

    interop.py export DIR       build pn_models.build(), write into DIR:
                                  state.pt        torch.save(state_dict), the reference weights
                                  args_tree.json  the model's _args with nested modules as subtrees
                                  pn_zip.mdlus    Module.save (2.2.2's zip)
                                  pn_tar.mdlus    the same as a pre-2.0 tar, checked with from_checkpoint
                                pn_ckpt/        save_checkpoint at epochs 1 and 2 (+ pn_ckpt_expected_N.pt)
    interop.py check-mdlus DIR  load DIR/ours.mdlus (written by checkpointd) with TinyNet.from_checkpoint,
                                Module.from_checkpoint and model.load; compare with DIR/state.pt
    interop.py load-step STEP_DIR EXPECTED
                                physicsnemo.utils.checkpoint.load_checkpoint of an uncompressed checkpointd
                                step directory into fresh models, Adam and StepLR; compare with EXPECTED
                                (torch.save of the state dicts at save time); from_checkpoint its .mdlus;
                                every .pt in it loads with weights_only=True
Prints "OK <what>" lines; any mismatch raises (non-zero exit, traceback on stderr).
"""

from __future__ import annotations

import json
import math
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import torch
from physicsnemo.core import Module

import pn_models


def args_tree(module: Module) -> dict[str, Any]:
    """``module._args`` as JSON: a nested Module becomes ``{"__nested__": its tree}``; plus its version."""
    init_args = {
        name: {"__nested__": args_tree(value)} if isinstance(value, Module) else value
        for name, value in module._args["__args__"].items()
    }
    return {
        "args": {**module._args, "__args__": init_args},
        "version": module.__model_checkpoint_version__,
    }


def export(out: Path) -> None:
    model = pn_models.build()
    torch.save(model.state_dict(), out / "state.pt")
    (out / "args_tree.json").write_text(json.dumps(args_tree(model)))
    model.save(str(out / "pn_zip.mdlus"))
    write_tar_mdlus(out / "pn_zip.mdlus", out / "pn_tar.mdlus")
    assert_same_state(Module.from_checkpoint(str(out / "pn_tar.mdlus")), model.state_dict(), "tar format")
    save_pn_checkpoints(out / "pn_ckpt", out)
    print("OK export")


def save_pn_checkpoints(ckpt_dir: Path, out: Path) -> None:
    """PhysicsNeMo's own ``save_checkpoint`` at epochs 1 and 2 (a TinyNet .mdlus, a Sequential .pt,
    checkpoint.0.N.pt); what each epoch holds goes to ``out/pn_ckpt_expected_<N>.pt``."""
    from physicsnemo.utils.checkpoint import save_checkpoint

    net, plain, optimizer, scheduler = pn_models.build_training(seed=3)
    ckpt_dir.mkdir()
    for epoch in (1, 2):
        loss = net(torch.randn(5, 4)).square().sum() + net.conv(torch.randn(1, 2, 5, 5)).sum()
        (loss + plain(torch.randn(5, 3)).square().sum()).backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        save_checkpoint(str(ckpt_dir), models=[net, plain], optimizer=optimizer, scheduler=scheduler,
                        epoch=epoch, metadata={"loss": float(epoch)})
        torch.save({"TinyNet": net.state_dict(), "Sequential": plain.state_dict(),
                    "optimizer_state_dict": optimizer.state_dict(), "scheduler_state_dict": scheduler.state_dict()},
                   out / f"pn_ckpt_expected_{epoch}.pt")


def write_tar_mdlus(zip_path: Path, tar_path: Path) -> None:
    """A pre-2.0 ``.mdlus``: PhysicsNeMo < 2.0's ``Module.save`` wrote these three files into a plain tar.

    2.2.2's own ``save(legacy_format=True)`` fails on local paths (``fs.put`` treats the target as a
    folder), so the tar is built here as PhysicsNeMo < 2.0 builds it, from the members of 2.2.2's zip.
    """
    with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(zip_path) as zf:
        staging = Path(tmp)
        for name in ("model.pt", "args.json", "metadata.json"):
            (staging / name).write_bytes(zf.read(name))
        with tarfile.open(tar_path, "w") as tar:
            for file in staging.iterdir():
                tar.add(str(file), arcname=file.name)


def assert_same_state(model: torch.nn.Module, expected: dict[str, torch.Tensor], what: str) -> None:
    got = model.state_dict()
    assert list(got) == list(expected), f"{what}: keys {list(got)} != {list(expected)}"
    for key, tensor in expected.items():
        assert torch.equal(got[key], tensor), f"{what}: {key} differs"
    print(f"OK {what}")


def assert_structure(model: Module, what: str) -> None:
    assert type(model) is pn_models.TinyNet, type(model)
    assert type(model.encoder) is pn_models.TinyEncoder, type(model.encoder)
    assert type(model.encoder.act) is pn_models.TinyAct, type(model.encoder.act)
    assert model.encoder.act.slope == 0.2 and math.isinf(model.encoder.clip)
    assert model._args["__args__"]["name"] == "tiny-net"
    print(f"OK {what} structure")


def check_mdlus(out: Path) -> None:
    expected = torch.load(out / "state.pt", weights_only=True)
    path = str(out / "ours.mdlus")
    by_class = pn_models.TinyNet.from_checkpoint(path)
    assert_structure(by_class, "TinyNet.from_checkpoint")
    assert_same_state(by_class, expected, "TinyNet.from_checkpoint")
    by_import = Module.from_checkpoint(path)  # resolves TinyNet through args.json's __module__
    assert_structure(by_import, "Module.from_checkpoint")
    assert_same_state(by_import, expected, "Module.from_checkpoint")
    target = pn_models.build(seed=1)
    target.load(path)
    assert_same_state(target, expected, "Module.load")


def assert_same_tree(got: Any, expected: Any, where: str, strides: bool = True) -> None:
    """Equal nested state: dicts, lists, plain values, tensors with equal values (and strides)."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        assert torch.equal(got, expected), f"{where}: values differ"
        assert not strides or got.stride() == expected.stride(), (
            f"{where}: strides {got.stride()} != {expected.stride()} at save time (a channels_last layout lost?)"
        )
    elif isinstance(expected, dict):
        assert isinstance(got, dict) and list(got) == list(expected), f"{where}: {list(got)} != {list(expected)}"
        for key in expected:
            assert_same_tree(got[key], expected[key], f"{where}.{key}", strides)
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), where
        for i, (g, e) in enumerate(zip(got, expected)):
            assert_same_tree(g, e, f"{where}[{i}]", strides)
    else:
        assert got == expected, f"{where}: {got!r} != {expected!r}"


def load_step(step_dir: Path, expected_path: Path) -> None:
    from physicsnemo.utils.checkpoint import load_checkpoint

    expected = torch.load(expected_path, weights_only=True)
    net, plain, optimizer, scheduler = pn_models.build_training(seed=1)
    metadata: dict[str, Any] = {}
    epoch = load_checkpoint(
        str(step_dir), models=[net, plain], optimizer=optimizer, scheduler=scheduler, metadata_dict=metadata
    )
    assert epoch == expected["step"], epoch
    print(f"OK load_checkpoint epoch {epoch}")
    assert_same_tree(net.state_dict(), expected["net"], "net")
    assert_same_tree(plain.state_dict(), expected["plain"], "plain")
    assert_same_tree(optimizer.state_dict(), expected["optimizer"], "optimizer")
    assert_same_tree(scheduler.state_dict(), expected["scheduler"], "scheduler")
    print("OK load_checkpoint state")
    (mdlus,) = step_dir.glob("TinyNet.0.*.mdlus")
    rebuilt = Module.from_checkpoint(str(mdlus))  # a fresh TinyNet: its conv weight is not channels_last
    assert_same_tree(rebuilt.state_dict(), expected["net"], "from_checkpoint", strides=False)
    print("OK step from_checkpoint")
    for pt in sorted(step_dir.glob("*.pt")):
        torch.load(pt, weights_only=True)
    print("OK step weights_only")


if __name__ == "__main__":
    command, args = sys.argv[1], [Path(a) for a in sys.argv[2:]]
    {"export": export, "check-mdlus": check_mdlus, "load-step": load_step}[command](*args)
