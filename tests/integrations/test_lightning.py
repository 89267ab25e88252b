"""``CheckpointdIO`` with the real Lightning Trainer and ModelCheckpoint, on CPU.

What a user relies on: ModelCheckpoint's files (top-k, last, links, every N steps) appear and go as
with Lightning's own ``torch.save`` IO, each holding the values of its save step; ``ckpt_path="last"``
and a reported path resume bit-exactly, also in a fresh process after a SIGKILL; a pointer whose save
never committed falls back to the newest complete checkpoint; background failures surface. Lightning
resumes a plain DataLoader at epoch boundaries only (mid-epoch it restarts the epoch's batches, with
its own IO too), so the bit-exact tests checkpoint at epoch ends.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

from checkpointd import CheckpointWriteError, ConfigError, IncompleteCheckpointError, StateError
from checkpointd.integrations.lightning import CheckpointdIO, load_checkpoint
from checkpointd.testing.faults import Fault, FaultPlan, disk_full_error

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "lightning_trainer.py"
BATCHES = 4
"""Batches per epoch of the tiny run."""

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


class TinyModule(pl.LightningModule):
    """Two linear layers, Adam with a StepLR schedule: a few hundred bytes of state."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=0.01)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)]


def _loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(4 * BATCHES, 4, generator=g), torch.randn(4 * BATCHES, 1, generator=g))
    return torch.utils.data.DataLoader(data, batch_size=4, shuffle=False)


def _fit(root_dir: Path, max_steps: int, *, plugins: list[Any] | None = None, callbacks: list[Any] | None = None,
         ckpt_path: str | None = None, **checkpoint_kwargs: Any) -> tuple[TinyModule, pl.Trainer, ModelCheckpoint]:
    """Train ``TinyModule`` from seed 0 to ``max_steps``, checkpoints in ``root_dir/ckpt`` (every epoch's end
    unless told otherwise)."""
    pl.seed_everything(0, verbose=False)
    module = TinyModule()
    checkpoint_kwargs.setdefault("every_n_train_steps", BATCHES)
    ckpt = ModelCheckpoint(dirpath=root_dir / "ckpt", **checkpoint_kwargs)
    trainer = pl.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, deterministic=True, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=root_dir,
                         callbacks=[*(callbacks or []), ckpt], plugins=plugins or [])
    trainer.fit(module, _loader(), ckpt_path=ckpt_path)
    return module, trainer, ckpt


def _train_state(module: pl.LightningModule, trainer: pl.Trainer) -> dict[str, Any]:
    """What a bit-exact resume must reproduce: weights, optimizer and scheduler state, the step."""
    return {"weights": _deep_clone(module.state_dict()), "optimizer": _deep_clone(trainer.optimizers[0].state_dict()),
            "schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs],
            "global_step": trainer.global_step}


def _deep_clone(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _deep_clone(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_deep_clone(v) for v in tree]
    return tree


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The state after 12 uninterrupted steps (Lightning's own IO)."""
    return _train_state(*_fit(tmp_path_factory.mktemp("full"), 12)[:2])


def _assert_same_tree(a: Any, b: Any, where: str = "") -> None:
    """Bit-exact equality of nested dicts/lists of tensors and plain values."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"
        for k in a:
            _assert_same_tree(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same_tree(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _steps_in(root: Path) -> set[int]:
    return {int(p.name.split("-")[1]) for p in root.glob("step-*") if (p / "COMMITTED").exists()}


def _pointer_targets(ckpt_dir: Path) -> set[int]:
    return {json.loads(p.read_text())["step"] for p in ckpt_dir.glob("*.ckpt") if not p.is_symlink()}


# -- ModelCheckpoint's files ----------------------------------------------------------------------
@pytest.mark.parametrize("save_last,max_pending", [(True, 2), ("link", 1)])
def test_top_k_last_and_every_n_steps_files_match_torch_io(tmp_path: Path, save_last: Any, max_pending: int) -> None:
    kw = dict(every_n_train_steps=2, save_top_k=2, monitor="loss", mode="min", save_last=save_last)
    _fit(tmp_path / "torch", 12, **kw)
    _fit(tmp_path / "ckd", 12, plugins=[CheckpointdIO(max_pending=max_pending)], **kw)
    torch_dir, ckd_dir = tmp_path / "torch" / "ckpt", tmp_path / "ckd" / "ckpt"
    names = sorted(p.name for p in torch_dir.iterdir())
    assert len(names) == 3 and "last.ckpt" in names  # two top-k files and last, as ModelCheckpoint decided
    assert sorted(p.name for p in ckd_dir.iterdir() if p.name != ".checkpointd") == names
    assert (ckd_dir / "last.ckpt").is_symlink() == (save_last == "link") == (torch_dir / "last.ckpt").is_symlink()
    io = CheckpointdIO()
    for name in names:
        theirs = torch.load(torch_dir / name, weights_only=True)
        ours = io.load_checkpoint(ckd_dir / name)
        assert ours["global_step"] == theirs["global_step"]
        _assert_same_tree(theirs["state_dict"], ours["state_dict"], name)
        _assert_same_tree(theirs["optimizer_states"], ours["optimizer_states"], name)
    # every step in the root belongs to a pointer; removed and overwritten files gave theirs up
    assert _steps_in(ckd_dir / ".checkpointd") == _pointer_targets(ckd_dir)
    assert len(_pointer_targets(ckd_dir)) == (2 if save_last == "link" else 3)


class _CopyAtSave(Callback):
    """Copies of the state at each checkpoint step, taken before ModelCheckpoint (which runs last) saves."""

    def __init__(self, every: int) -> None:
        self.every, self.copies = every, {}

    def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
        if trainer.global_step % self.every == 0:
            self.copies[trainer.global_step] = {"state_dict": _deep_clone(module.state_dict()),
                                                "optimizer": _deep_clone(trainer.optimizers[0].state_dict())}


def test_each_checkpoint_holds_the_values_of_its_save_step(tmp_path: Path) -> None:
    copier = _CopyAtSave(every=2)
    _fit(tmp_path, 12, plugins=[CheckpointdIO()], callbacks=[copier], every_n_train_steps=2, save_top_k=-1)
    files = sorted((tmp_path / "ckpt").glob("*.ckpt"))
    assert len(files) == 6 and sorted(copier.copies) == [2, 4, 6, 8, 10, 12]
    for f in files:
        ckpt = load_checkpoint(f)
        expected = copier.copies[ckpt["global_step"]]
        _assert_same_tree(expected["state_dict"], ckpt["state_dict"], f.name)
        _assert_same_tree(expected["optimizer"], ckpt["optimizer_states"][0], f.name)
    later = load_checkpoint(files[-1])["state_dict"]["net.0.weight"]
    assert not torch.equal(later, copier.copies[2]["state_dict"]["net.0.weight"])  # training moved the weights


# -- resume ---------------------------------------------------------------------------------------
def test_resume_from_last_and_from_a_reported_path_is_bit_exact(tmp_path: Path, uninterrupted: dict[str, Any]) -> None:
    full = uninterrupted
    _, _, ckpt = _fit(tmp_path / "run", 8, plugins=[CheckpointdIO()], save_last=True)
    reported = ckpt.best_model_path  # epoch=1-step=8.ckpt, as ModelCheckpoint reported it
    assert reported.endswith("step=8.ckpt") and os.path.exists(reported)
    from_reported = _train_state(*_fit(tmp_path / "run2", 12, plugins=[CheckpointdIO()], ckpt_path=reported)[:2])
    _assert_same_tree(full, from_reported)
    from_last = _train_state(*_fit(tmp_path / "run", 12, plugins=[CheckpointdIO()], ckpt_path="last",
                                     save_last=True)[:2])
    _assert_same_tree(full, from_last)


def test_a_save_that_never_committed_falls_back_to_the_newest_complete_one(tmp_path: Path,
                                                                          uninterrupted: dict[str, Any]) -> None:
    """The state a kill between pointer and commit leaves (the marker of last.ckpt's step absent):
    loading gives the newest checkpoint committed before that save began, with a warning, and the
    run resumes from it bit-exactly."""
    _fit(tmp_path / "run", 8, plugins=[CheckpointdIO()], save_last=True)
    ckpt_dir = tmp_path / "run" / "ckpt"
    pointer = json.loads((ckpt_dir / "last.ckpt").read_text())
    (ckpt_dir / ".checkpointd" / f"step-{pointer['step']:09d}" / "COMMITTED").unlink()
    with pytest.warns(RuntimeWarning, match=f"names step {pointer['step']}, which is not a complete checkpoint"):
        got = CheckpointdIO().load_checkpoint(ckpt_dir / "last.ckpt")
    assert got["global_step"] == 8  # the top-k save of the same step committed just before
    with pytest.warns(RuntimeWarning, match="not a complete checkpoint"):
        resumed = _train_state(*_fit(tmp_path / "run", 12, plugins=[CheckpointdIO()], ckpt_path="last",
                                       save_last=True)[:2])
    _assert_same_tree(uninterrupted, resumed)


def test_a_first_save_that_never_committed_says_what_to_do(tmp_path: Path) -> None:
    io = CheckpointdIO()
    path = tmp_path / "first.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.ones(3)}, "global_step": 1}, path)
    io.teardown()
    next((tmp_path / ".checkpointd").glob("step-*/COMMITTED")).unlink()
    with pytest.raises(IncompleteCheckpointError, match="no earlier checkpoint had committed. Delete"):
        io.load_checkpoint(path)


# -- errors and foreign files ---------------------------------------------------------------------
def test_a_background_failure_raises_at_the_next_save_and_at_teardown(tmp_path: Path) -> None:
    plan = FaultPlan(Fault(op="write", path="*step-000000002*", error=disk_full_error))
    opts = {"target_protocol": "file", "faults": plan}
    with pytest.raises(CheckpointWriteError, match="step 2"):  # the fit's next save raises it
        _fit(tmp_path / "a", 12, plugins=[CheckpointdIO(f"faulty://{tmp_path}/a-root", storage_options=opts)])
    io = CheckpointdIO(f"faulty://{tmp_path}/b-root", storage_options=opts)
    io.save_checkpoint({"w": torch.ones(2)}, tmp_path / "b1.ckpt")
    io.save_checkpoint({"w": torch.ones(2)}, tmp_path / "b2.ckpt")  # step 2 fails in the background
    with pytest.raises(CheckpointWriteError, match="step 2"):
        io.teardown()
    assert load_checkpoint(tmp_path / "b1.ckpt", storage_options=opts)["w"].tolist() == [1.0, 1.0]


def test_bad_state_raises_from_save_checkpoint_and_storage_options_are_refused(tmp_path: Path) -> None:
    io = CheckpointdIO()
    with pytest.raises(StateError, match=r"\['hyper_parameters'\]\['loss_fn'\]"):
        io.save_checkpoint({"state_dict": {}, "hyper_parameters": {"loss_fn": torch.nn.MSELoss()}}, tmp_path / "x.ckpt")
    assert not (tmp_path / "x.ckpt").exists()
    with pytest.raises(ConfigError, match="pass storage_options=... to CheckpointdIO"):
        io.save_checkpoint({"w": torch.ones(1)}, tmp_path / "y.ckpt", storage_options={"a": 1})
    io.teardown()
    with pytest.raises(ConfigError, match=r"max_pending=...\) must be an int >= 1, got 0"):
        CheckpointdIO(max_pending=0)


class _Custom:
    def __init__(self) -> None:
        self.x = 1


def test_a_torch_save_checkpoint_loads_through_torch_io_weights_only(tmp_path: Path) -> None:
    _, _, ckpt = _fit(tmp_path / "torch", 4)  # Lightning's own TorchCheckpointIO wrote this file
    plain = ckpt.best_model_path
    _assert_same_tree(torch.load(plain, weights_only=True)["state_dict"], CheckpointdIO().load_checkpoint(plain)["state_dict"])
    unsafe = tmp_path / "unsafe.ckpt"
    torch.save({"obj": _Custom()}, unsafe)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        CheckpointdIO().load_checkpoint(unsafe)
    assert CheckpointdIO().load_checkpoint(unsafe, weights_only=False)["obj"].x == 1  # the caller trusts it
    with pytest.raises(ConfigError, match="not a checkpointd pointer"):
        load_checkpoint(plain)


def test_lightning_async_checkpoint_io_holds_the_save_step_values(tmp_path: Path) -> None:
    """Lightning's AsyncCheckpointIO clones every tensor on the calling thread before it returns, so
    changing the live tensors right after ``save_checkpoint`` cannot reach its file (deterministic:
    the clone happens before the call returns, whenever its writer thread runs)."""
    live = {"w": torch.zeros(1000), "opt": {"state": {0: {"exp_avg": torch.zeros(1000)}}}}
    io = AsyncCheckpointIO(TorchCheckpointIO())
    io.save_checkpoint(live, tmp_path / "a.ckpt")
    live["w"].add_(1.0)
    live["opt"]["state"][0]["exp_avg"].add_(1.0)
    io.teardown()
    saved = torch.load(tmp_path / "a.ckpt", weights_only=True)
    assert torch.equal(saved["w"], torch.zeros(1000)) and torch.equal(saved["opt"]["state"][0]["exp_avg"], torch.zeros(1000))


# -- the example, SIGKILLed and resumed in a fresh process ------------------------------------------
def _load_example() -> Any:
    spec = importlib.util.spec_from_file_location("lightning_trainer_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_example_killed_mid_run_resumes_in_a_fresh_process_bit_exactly(tmp_path: Path) -> None:
    """The crash test: the example trains with the plugin and SIGKILLs itself at global step 20, after
    the checkpoint of step 8 committed (its save at 16 waited for it) and with the saves of step 16
    committed or in flight; a fresh process resumes with ckpt_path="last" and its final checkpoint
    equals an uninterrupted run of the same code, bit for bit."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    run = [sys.executable, str(EXAMPLE), "--dir", str(tmp_path / "ex"), "--steps", "24"]
    killed = subprocess.run([*run, "--kill-at", "20"], env=env, capture_output=True, text=True, timeout=180)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert "started at global step 0" in killed.stdout and "killed at global step 20" in killed.stdout
    committed = [p.parent.name for p in (tmp_path / "ex" / "ckpt" / ".checkpointd").glob("step-*/COMMITTED")]
    assert committed, "no checkpoint committed before the kill"
    resumed = subprocess.run(run, env=env, capture_output=True, text=True, timeout=180)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    started = [line for line in resumed.stdout.splitlines() if line.startswith("started at global step")]
    assert started in (["started at global step 16"], ["started at global step 8"]), resumed.stdout
    assert "finished at global step 24" in resumed.stdout
    trainer, model, _ = _load_example().train(str(tmp_path / "reference"), 24)  # the same code, never killed
    final = load_checkpoint(tmp_path / "ex" / "ckpt" / "last.ckpt")
    assert final["global_step"] == trainer.global_step == 24
    _assert_same_tree(_deep_clone(model.state_dict()), final["state_dict"], "state_dict")
    _assert_same_tree(_deep_clone(trainer.optimizers[0].state_dict()), final["optimizer_states"][0], "optimizer")
