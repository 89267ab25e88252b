"""Partial and non-strict restores (``entries=``, ``strict=``) and ``restore_from`` a foreign checkpoint.

The checkpoints restored here: full mode written by one process, and sharded mode written by two gloo
ranks with FSDP2 (``dist_harness``), each with compression None and zstd, each read from a local root
and from a ``memory://`` copy of it. What a restore must give back is what ``checkpointd.load`` reads
from the same step, bit for bit.

Decisions these tests pin down (the manager's and ``manager_restore.py``'s docstrings say them):
``strict=False`` leaves entries the checkpoint lacks and, inside a module, missing, unexpected and
reshaped keys as they are (one RuntimeWarning names them all), but keeps an optimizer strict; RNG state
is restored only when every registered entry is; ``entries=`` reads only the files of the chosen
entries, so damage elsewhere in the step does not stop a model-only restore.
"""

from __future__ import annotations

import os
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
import torch.nn as nn

from dist_harness import fsdp2_with_adamw, run_distributed, train_same_batches
from tree_compare import assert_tree_equal

import checkpointd
from checkpointd import CheckpointManager
from checkpointd import ConfigError, DistributedOptions, StagingOptions, StateMismatchError

FEATURES = 6


def _manager(root: Any, state: dict[str, Any], **kwargs: Any) -> CheckpointManager:
    """A manager without the gc freeze: each construction would collect the test process's large heap."""
    return CheckpointManager(root, state, staging=StagingOptions(freeze_gc=False), **kwargs)


class Net(nn.Module):
    """``a`` (sharded first by ``fsdp2_with_adamw``) and a classification ``head`` of ``classes`` outputs."""

    def __init__(self, classes: int = 3) -> None:
        super().__init__()
        self.a = nn.Linear(FEATURES, 8)
        self.head = nn.Linear(8, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.a(x)))


def _fresh(seed: int = 5, classes: int = 3) -> tuple[Net, torch.optim.AdamW]:
    """A model and optimizer unlike the saved ones: one step on other data gives the optimizer state."""
    torch.manual_seed(seed)
    model = Net(classes)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    train_same_batches(model, opt, 1, seed=seed + 1, features=FEATURES)
    return model, opt


def _moments(osd: dict[str, Any]) -> list[torch.Tensor]:
    """Every per-parameter state tensor of an optimizer state dict, in parameter order (index or FQN keys)."""
    keys = [k for g in osd["param_groups"] for k in g["params"]]
    return [osd["state"][k][name] for k in keys for name in ("exp_avg", "exp_avg_sq")]


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "moments": [t.clone() for t in _moments(opt.state_dict())]}


# -- checkpoints to restore ----------------------------------------------------------------------------
def _save_full(root: Path, codec: str | None) -> torch.Tensor:
    """Steps 8 and 10 of {model, optim} by one process; returns the RNG draw right after saving step 10."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    with _manager(root, {"model": model, "optim": opt}, compression=codec) as mgr:
        for step in (8, 10):
            train_same_batches(model, opt, 1, seed=step, features=FEATURES)
            mgr.save(step)
        after = torch.rand(3)
    return after


def save_sharded(rank: int, world: int, roots: dict[str, str]) -> None:
    """Steps 8 and 10 of an FSDP2 model and its AdamW, sharded over the ranks, once per codec."""
    for codec, root in roots.items():
        model, opt = fsdp2_with_adamw(Net, seed=0)
        with _manager(root, {"model": model, "optim": opt}, mode="sharded", compression=None if codec == "none" else codec,
                               distributed=DistributedOptions(timeout_secs=30)) as mgr:
            for step in (8, 10):
                train_same_batches(model, opt, 1, seed=step, features=FEATURES)
                mgr.save(step)


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], tuple[Path, torch.Tensor | None]]:
    """(kind, codec) -> (local root, RNG draw after the save of step 10 or None for sharded)."""
    base = tmp_path_factory.mktemp("subset")
    out: dict[tuple[str, str], tuple[Path, torch.Tensor | None]] = {}
    for codec in ("none", "zstd"):
        out[("full", codec)] = (base / f"full-{codec}", _save_full(base / f"full-{codec}", None if codec == "none" else codec))
    roots = {codec: str(base / f"sharded-{codec}") for codec in ("none", "zstd")}
    run_distributed(save_sharded, 2, roots)
    for codec, root in roots.items():
        out[("sharded", codec)] = (Path(root), None)
    return out


def _copy_to_memory(local: Path) -> str:
    fs = fsspec.filesystem("memory")
    root = f"/checkpointd-subset/{uuid.uuid4().hex}"
    for dirpath, _, names in os.walk(local):
        for n in names:
            rel = os.path.relpath(os.path.join(dirpath, n), local)
            fs.pipe_file(f"{root}/{rel}", Path(dirpath, n).read_bytes())
    return f"memory://{root}"


CASES = [(kind, codec, where) for kind in ("full", "sharded") for codec in ("none", "zstd") for where in ("local", "memory")]


@pytest.fixture(params=CASES, ids=["-".join(c) for c in CASES])
def case(request: pytest.FixtureRequest, written: Any) -> dict[str, Any]:
    kind, codec, where = request.param
    local, rng_after = written[(kind, codec)]
    root = str(local) if where == "local" else _copy_to_memory(local)
    return {"kind": kind, "root": root, "rng_after": rng_after, "saved": checkpointd.load(root, step=10)}


def _assert_model(model: nn.Module, saved: dict[str, Any]) -> None:
    assert_tree_equal(dict(model.state_dict()), dict(saved["model"]))


# -- strict=False: a run that registered one entry more since its last checkpoint ------------------------
def test_strict_false_resumes_a_run_that_added_an_entry(case: dict[str, Any]) -> None:
    model, opt = _fresh()
    before = _snapshot(model, opt)
    progress = {"seen": 123}
    with _manager(case["root"], {"model": model, "optim": opt, "progress": progress}) as mgr:
        with pytest.raises(StateMismatchError, match=r"checkpoint step 10 has no entry 'progress'.*strict=False"):
            mgr.restore_latest()
        assert_tree_equal(_snapshot(model, opt), before)  # refused before anything is applied
        torch.manual_seed(77)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert mgr.restore_latest(strict=False) == 10
        drawn = torch.rand(3)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert messages == ["checkpointd: step 10 has no entry 'progress'; left as it is"]
    _assert_model(model, case["saved"])
    assert_tree_equal(_moments(opt.state_dict()), _moments(case["saved"]["optim"]))
    assert progress == {"seen": 123}
    if case["rng_after"] is not None:  # every registered entry the step holds came back: RNG too
        assert torch.equal(drawn, case["rng_after"])


def test_entries_restores_only_the_named_entries(case: dict[str, Any]) -> None:
    model, opt = _fresh()
    before = _snapshot(model, opt)
    progress = {"seen": 123}
    with _manager(case["root"], {"model": model, "optim": opt, "progress": progress}) as mgr:
        torch.manual_seed(77)
        expected_draw = torch.rand(3)
        torch.manual_seed(77)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing left over: no warning
            mgr.restore(10, entries=["model"])
        assert torch.equal(torch.rand(3), expected_draw)  # a model-only restore keeps the run's RNG
        _assert_model(model, case["saved"])
        assert_tree_equal(_moments(opt.state_dict()), before["moments"])
        assert progress == {"seen": 123}
        mgr.restore(8, entries=("optim", "model"), strict=False)  # any iterable; progress is not asked for
        assert_tree_equal(_moments(opt.state_dict()), _moments(checkpointd.load(case["root"], step=8)["optim"]))


def test_named_entry_the_step_lacks(case: dict[str, Any]) -> None:
    model, opt = _fresh()
    before = _snapshot(model, opt)
    progress = {"seen": 1}
    with _manager(case["root"], {"model": model, "optim": opt, "progress": progress}) as mgr:
        with pytest.raises(StateMismatchError, match="checkpoint step 10 has no entry 'progress'"):
            mgr.restore_latest(entries=["model", "progress"])
        assert_tree_equal(_snapshot(model, opt), before)
        with pytest.warns(RuntimeWarning, match=r"^checkpointd: step 10 has no entry 'progress'; left as it is$"):
            assert mgr.restore_latest(entries=["progress", "model"], strict=False) == 10
    _assert_model(model, case["saved"])
    assert progress == {"seen": 1}
    assert_tree_equal(_moments(opt.state_dict()), before["moments"])


def test_entries_must_be_registered_names(tmp_path: Path, written: Any) -> None:
    root = str(written[("full", "zstd")][0])
    model, opt = _fresh()
    before = _snapshot(model, opt)
    with _manager(root, {"model": model, "optim": opt}) as mgr:
        with pytest.raises(ConfigError, match=r"'modle', not registered; the registered state names are \['model', 'optim'\]"):
            mgr.restore_latest(entries=["modle"])
        with pytest.raises(ConfigError, match=r"entries='model' is a string; pass a list"):
            mgr.restore(10, entries="model")
        with pytest.raises(ConfigError, match="'extra', not registered"):
            mgr.restore_from(root, entries=["model", "extra"])
    assert_tree_equal(_snapshot(model, opt), before)


def test_strict_false_ignores_checkpoint_entries_nobody_registered(written: Any) -> None:
    root = str(written[("full", "none")][0])
    model, _ = _fresh()
    with _manager(root, {"model": model}) as mgr:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert mgr.restore_latest() == 10  # strict, as always: an unregistered checkpoint entry is ignored silently
        with pytest.warns(RuntimeWarning, match=r"^checkpointd: step 10 holds entry 'optim', not registered; ignored$"):
            assert mgr.restore_latest(strict=False) == 10
    _assert_model(model, checkpointd.load(root))


# -- what strict=False means inside a module, and inside an optimizer ------------------------------------
class Adapted(nn.Module):
    """Net with a head of 5 classes, an extra ``adapter`` layer, and ``a`` renamed in part: no ``a.bias``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(FEATURES, 8, bias=False)
        self.adapter = nn.Linear(8, 8)
        self.head = nn.Linear(8, 5)


@pytest.mark.parametrize("path", ["bulk", "per-entry"])
def test_strict_false_inside_a_module_is_load_state_dict_strict_false(written: Any, path: str) -> None:
    root = str(written[("full", "zstd")][0])
    saved = checkpointd.load(root)["model"]
    torch.manual_seed(3)
    live = Adapted()
    if path == "per-entry":  # a load_state_dict pre-hook: the module takes torch's own load_state_dict
        live.register_load_state_dict_pre_hook(lambda *args, **kwargs: None)
    before = {k: v.clone() for k, v in live.state_dict().items()}
    with _manager(root, {"model": live}) as mgr:
        with pytest.raises(StateMismatchError, match=r"state\['model'\] \(Adapted\) does not match step 10: missing keys"):
            mgr.restore(10)
        with pytest.warns(RuntimeWarning) as caught:
            mgr.restore(10, strict=False)
    (message,) = [str(w.message) for w in caught]
    assert message == (
        "checkpointd: state['model'] (Adapted): keys 'head.weight' (live (5, 8), saved (3, 8)), 'head.bias' (live (5,), "
        "saved (3,)) of another shape and keys 'adapter.weight', 'adapter.bias' missing from step 10 left as they are; "
        "saved key 'a.bias' not in the module ignored; step 10 holds entry 'optim', not registered; ignored")
    after = live.state_dict()
    assert torch.equal(after["a.weight"], saved["a.weight"])  # the one key both hold with one shape
    for k in ("adapter.weight", "adapter.bias", "head.weight", "head.bias"):
        assert torch.equal(after[k], before[k]), k


def test_strict_false_keeps_an_optimizer_strict(written: Any) -> None:
    root = str(written[("full", "zstd")][0])
    model, _ = _fresh()
    opt = torch.optim.AdamW(model.head.parameters())  # other parameters than were saved
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with _manager(root, {"model": model, "optim": opt}) as mgr:
        with pytest.raises(StateMismatchError, match=r"state\['optim'\] \(AdamW\): live parameter groups of sizes \[2\], "
                                                     r"saved \[4\] at step 10.*strict=False does not apply inside an optimizer"):
            mgr.restore_latest(strict=False)
        for k, v in model.state_dict().items():  # checked before anything is applied
            assert torch.equal(v, before[k]), k
        mgr.restore_latest(entries=["model"])  # the way out the message names
    _assert_model(model, checkpointd.load(root))


# -- verification: a partial restore reads (and verifies) only its files ---------------------------------
def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_model_only_restore_reads_only_the_model_file(tmp_path: Path, written: Any) -> None:
    root = tmp_path / "root"
    shutil.copytree(written[("full", "zstd")][0], root)
    saved = {s: checkpointd.load(root, step=s) for s in (8, 10)}
    _flip_byte(root / "step-000000010" / "checkpoint.0.10.pt.zst")  # the optimizer's file (and RNG's)
    model, opt = _fresh()
    with _manager(root, {"model": model, "optim": opt}) as mgr:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert mgr.restore_latest(entries=["model"]) == 10  # the damaged file is not read
        _assert_model(model, saved[10])
        assert mgr.steps() == [8, 10]
        with pytest.warns(RuntimeWarning, match="skipping step 10, it does not verify"):
            assert mgr.restore_latest() == 8  # every file is read: step 10 fails and is taken out
        assert mgr.steps() == [8]
    _assert_model(model, saved[8])


def test_damaged_model_file_falls_back_in_a_partial_restore(tmp_path: Path, written: Any) -> None:
    root = tmp_path / "root"
    shutil.copytree(written[("full", "none")][0], root)
    saved8 = checkpointd.load(root, step=8)
    _flip_byte(root / "step-000000010" / "Net.0.10.pt")
    model, opt = _fresh()
    with _manager(root, {"model": model, "optim": opt, "progress": {}}) as mgr:
        with pytest.warns(RuntimeWarning) as caught:
            assert mgr.restore_latest(entries=["model", "progress"], strict=False) == 8
        messages = [str(w.message) for w in caught]
        assert len(messages) == 2 and messages[0].startswith("checkpointd: skipping step 10, it does not verify")
        assert messages[1] == "checkpointd: step 8 has no entry 'progress'; left as it is"
        assert mgr.steps() == [8]
        assert [n.split("-")[1] for n in os.listdir(root / ".checkpointd-damaged")] == ["000000010"]
    _assert_model(model, saved8)


# -- two tiers ---------------------------------------------------------------------------------------------
def test_two_tier_partial_and_non_strict(tmp_path: Path) -> None:
    remote = f"memory://checkpointd-subset/{uuid.uuid4().hex}"
    model, opt = _fresh(seed=0)
    with _manager(remote, {"model": model, "optim": opt}, local_dir=tmp_path / "local") as mgr:
        mgr.save(4)
    saved = checkpointd.load(remote)
    for local_copy in (True, False):
        if not local_copy:
            shutil.rmtree(tmp_path / "local")
        live, live_opt = _fresh()
        before = _moments(live_opt.state_dict())
        progress = {"n": 0}
        with _manager(remote, {"model": live, "optim": live_opt, "progress": progress},
                               local_dir=tmp_path / "local") as mgr:
            with pytest.raises(StateMismatchError, match="has no entry 'progress'"):
                mgr.restore_latest(entries=["progress"])
            with pytest.warns(RuntimeWarning, match="step 4 has no entry 'progress'; left as it is"):
                assert mgr.restore_latest(entries=["model", "progress"], strict=False) == 4
        _assert_model(live, saved)
        assert_tree_equal(_moments(live_opt.state_dict()), [t.clone() for t in before])


# -- restore_from: fine-tuning from another run's checkpoint ----------------------------------------------
def test_restore_from_another_root_fine_tunes_a_new_head(tmp_path: Path, case: dict[str, Any]) -> None:
    saved = case["saved"]["model"]
    torch.manual_seed(9)
    model = Net(classes=5)  # the same body, a new head
    head = {k: v.clone() for k, v in model.head.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    torch.manual_seed(77)
    expected_draw = torch.rand(3)
    with _manager(tmp_path / "finetune", {"model": model, "optim": opt}) as mgr:
        with pytest.raises(StateMismatchError, match=r"state\['model'\] key 'head.weight': live shape \(5, 8\), saved \(3, 8\)"):
            mgr.restore_from(case["root"], entries=["model"], step=10)
        torch.manual_seed(77)
        with pytest.warns(RuntimeWarning, match=r"keys 'head.weight' \(live \(5, 8\), saved \(3, 8\)\), 'head.bias' .* of another shape"):
            mgr.restore_from(case["root"], entries=["model"], strict=False, step=10)
        assert torch.equal(torch.rand(3), expected_draw)  # restore_from never restores RNG
        assert torch.equal(model.a.weight, saved["a.weight"]) and torch.equal(model.a.bias, saved["a.bias"])
        for k, v in head.items():
            assert torch.equal(getattr(model.head, k), v), k
        assert mgr.steps() == [] and not opt.state  # nothing of the root, nor the optimizer
        train_same_batches(model, opt, 1, seed=1, features=FEATURES)
        mgr.save(0)  # the fine-tune numbers its own steps
        mgr.wait()
        assert mgr.steps() == [0]
    fresh = Net(classes=3)
    with _manager(tmp_path / "other", {"model": fresh}) as mgr:
        with pytest.warns(RuntimeWarning, match=r"holds entry 'optim', not registered; ignored$"):
            mgr.restore_from(case["root"], strict=False)  # the newest step: 10
    _assert_model(fresh, case["saved"])


def test_restore_from_keeps_live_dtype_device_and_memory_format(tmp_path: Path) -> None:
    torch.manual_seed(0)
    conv = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    opt = torch.optim.SGD(conv.parameters(), lr=0.1, momentum=0.9)
    conv(torch.randn(2, 3, 6, 6)).sum().backward()
    opt.step()
    with _manager(tmp_path / "src", {"net": conv, "opt": opt}) as mgr:
        mgr.save(3)
    live = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).to(torch.float64, memory_format=torch.channels_last)
    live_opt = torch.optim.SGD(live.parameters(), lr=0.1, momentum=0.9)
    with _manager(tmp_path / "dst", {"net": live, "opt": live_opt}) as mgr:
        mgr.restore_from(tmp_path / "src")
    w = live[0].weight
    assert w.dtype == torch.float64 and w.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(w, conv[0].weight.to(torch.float64))
    assert torch.equal(live[1].running_var, conv[1].running_var.to(torch.float64))
    buf = live_opt.state[w]["momentum_buffer"]
    assert buf.dtype == torch.float64 and buf.stride() == w.stride()
    assert torch.equal(buf, opt.state[conv[0].weight]["momentum_buffer"].to(torch.float64))


def test_restore_from_step_dir_and_physicsnemo_dir(tmp_path: Path, written: Any) -> None:
    root = written[("full", "none")][0]
    saved = checkpointd.load(root, step=8)
    pn = tmp_path / "pn"  # the data files alone: a directory of PhysicsNeMo checkpoint files
    pn.mkdir()
    for f in (root / "step-000000008").iterdir():
        if f.name not in ("manifest.json", "COMMITTED"):
            shutil.copy(f, pn / f.name)
    for source in (root / "step-000000008", pn):
        model, opt = _fresh()
        with _manager(tmp_path / "mine", {"model": model, "optim": opt}) as mgr:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                mgr.restore_from(source)  # PhysicsNeMo names: Net (the module's file), optimizer_state_dict
        _assert_model(model, saved)
        assert_tree_equal(_moments(opt.state_dict()), _moments(saved["optim"]))
    with _manager(tmp_path / "mine", {"model": _fresh()[0], "extra": {"x": 1}}) as mgr:
        with pytest.raises(StateMismatchError, match=rf"checkpoint {pn} has no entry 'extra'"):
            mgr.restore_from(pn)


def test_restore_from_a_torchtitan_style_dcp_directory(tmp_path: Path) -> None:
    """TorchTitan saves with ``torch.distributed.checkpoint``: the model's keys flattened into the top
    level, beside ``optimizer`` (FQN-keyed) and ``train_state``; here written by one process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model, opt = _fresh(seed=0)
    state = {**get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt),
             "train_state": {"step": torch.tensor(30)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP: "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=str(tmp_path / "titan" / "step-30"))
    live, live_opt = _fresh(seed=4)
    with _manager(tmp_path / "mine", {"model": live, "optimizer": live_opt}) as mgr:
        with pytest.warns(RuntimeWarning, match=r"titan holds entry 'train_state', not registered; ignored$"):
            mgr.restore_from(tmp_path / "titan", strict=False)
    assert_tree_equal(dict(live.state_dict()), dict(model.state_dict()))
    assert_tree_equal(_moments(live_opt.state_dict()), _moments(opt.state_dict()))
    model_only = Net()
    with _manager(tmp_path / "mine2", {"model": model_only}) as mgr:
        mgr.restore_from(tmp_path / "titan" / "step-30", entries=["model"])  # one DCP directory
    assert_tree_equal(dict(model_only.state_dict()), dict(model.state_dict()))
