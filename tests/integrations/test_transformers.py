"""``CheckpointdCallback`` with the real Hugging Face ``Trainer`` on CPU (``examples/hf_trainer.py``'s tiny
``PreTrainedModel`` with dropout, 16 shuffled samples, batch 4, 12 steps, a save every 3 steps).

Checkpoints are committed on the Trainer's save schedule ("steps", "epoch", the manager's own, a
signal) and the Trainer writes none of its own; a run stopped and resumed through
``resume_checkpoint()`` gives the per-step losses and final weights of an uninterrupted run bit for
bit, as the Trainer's own resume from its own checkpoint does, mid-epoch and at an epoch boundary;
the directory handed to the Trainer holds what the Trainer's own checkpoint holds; damaged newest
steps are skipped, moved aside and saved again; the example, SIGKILLed in a child process after a
commit, resumes in a fresh process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from transformers import TrainerCallback
from transformers.trainer_pt_utils import safe_globals

from checkpointd import CheckpointManager, ConfigError, StagingOptions, StateMismatchError, load
from checkpointd.integrations.transformers import CheckpointdCallback

REPO = Path(__file__).resolve().parents[2]
EXAMPLE_PATH = REPO / "examples" / "hf_trainer.py"
_spec = importlib.util.spec_from_file_location("hf_trainer_example", EXAMPLE_PATH)
example = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(example)  # type: ignore[union-attr]

TOTAL_STEPS = 12


def make_callback(root: Any, **options: Any) -> CheckpointdCallback:
    """The callback without the manager's gc.freeze: its full collection costs about a second per manager
    in a pytest process that holds transformers, and the collector's tuning is not under test here."""
    return CheckpointdCallback(root, staging=StagingOptions(freeze_gc=False), **options)


class StopAt(TrainerCallback):
    """Ends training after ``step`` (an interrupted run, in process)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            control.should_training_stop = True


def losses(log_history: list[dict[str, Any]]) -> list[tuple[int, float]]:
    return [(h["step"], h["loss"]) for h in log_history if "loss" in h]


def committed(root: Path) -> list[int]:
    return sorted(int(p.parent.name.split("-")[1]) for p in root.glob("step-*/COMMITTED"))


def untimed(log_history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in h.items() if not k.endswith(("_runtime", "_per_second"))} for h in log_history]


def assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.fixture(scope="module", autouse=True)
def stalled_example(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The example in a child process, stalled at step 7 (after saves at 3 and 6) until the last test kills it.

    Started before the in-process tests so that the child's interpreter start overlaps them.
    """
    tmp = tmp_path_factory.mktemp("example")
    root, out, log = tmp / "root", tmp / "out", tmp / "first-run.log"
    cmd = [sys.executable, str(EXAMPLE_PATH), "--root", str(root), "--output-dir", str(out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    with open(log, "wb") as sink:
        child = subprocess.Popen([*cmd, "--stall-at", "7"], env=env, stdout=sink, stderr=subprocess.STDOUT)
    yield {"child": child, "root": root, "out": out, "log": log, "cmd": cmd, "env": env}
    child.kill()
    child.wait()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """An uninterrupted run of the plain Trainer (no callback, no saves): losses and final weights."""
    trainer = example.build_trainer(str(tmp_path_factory.mktemp("plain")), [], save_strategy="no")
    trainer.train()
    assert trainer.state.global_step == TOTAL_STEPS
    return {"losses": losses(trainer.state.log_history),
            "weights": {k: v.clone() for k, v in trainer.model.state_dict().items()}}


def test_resumes_like_an_uninterrupted_run_and_like_the_trainers_own_resume(tmp_path: Path, reference: dict) -> None:
    # interrupted after step 7: checkpoints at the save steps, none written by the Trainer
    root, out = tmp_path / "root", tmp_path / "out"
    first = example.build_trainer(str(out), [make_callback(root), StopAt(7)])
    first.train()
    assert committed(root) == [3, 6]
    assert not list(out.glob("checkpoint-*"))
    # the same run with the Trainer's own checkpoints
    hf_out = tmp_path / "out-hf"
    example.build_trainer(str(hf_out), [StopAt(7)]).train()

    callback = make_callback(root)
    second = example.build_trainer(str(out), [callback])
    path = Path(callback.resume_checkpoint())
    assert callback.resumed_step == 6 and path.name == "checkpoint-6" and path.parent.parent == out / "checkpointd-resume"
    compare_with_trainer_checkpoint(path, hf_out / "checkpoint-6")
    seen: list[int] = []

    class FirstStep(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            seen.append(state.global_step)

    second.add_callback(FirstStep())
    second.train(resume_from_checkpoint=str(path))
    assert seen[0] == 6 and second.state.global_step == TOTAL_STEPS  # continues with step 7
    assert losses(second.state.log_history) == reference["losses"]
    assert_same_weights(second.model.state_dict(), reference["weights"])
    assert callback.manager is None  # closed by on_train_end: every save committed
    assert committed(root) == [6, 9, 12]  # the final step too; keep_last=3
    assert not path.exists() and not (out / "checkpointd-resume").exists()
    final = load(root)
    assert_same_weights(final["model"], reference["weights"])
    assert losses(json.loads(final["trainer_state"]["json"])["log_history"]) == reference["losses"]

    # the Trainer's own resume from its own checkpoint is bit-exact as well on this run
    own = example.build_trainer(str(hf_out), [])
    own.train(resume_from_checkpoint=str(hf_out / "checkpoint-6"))
    assert losses(own.state.log_history) == reference["losses"]
    assert_same_weights(own.model.state_dict(), reference["weights"])


def compare_with_trainer_checkpoint(ours: Path, theirs: Path) -> None:
    """The directory handed to the Trainer holds what the Trainer's own checkpoint of that step holds."""
    # not read back on resume: the arguments, and the config (read only to compare transformers versions)
    assert {p.name for p in ours.iterdir()} == {p.name for p in theirs.iterdir()} - {"training_args.bin", "config.json"}
    assert_same_weights(safetensors.torch.load_file(ours / "model.safetensors"),
                        safetensors.torch.load_file(theirs / "model.safetensors"))
    for name in ("optimizer.pt", "scheduler.pt"):
        a, b = torch.load(ours / name, weights_only=True), torch.load(theirs / name, weights_only=True)
        assert repr(a) == repr(b), name  # same nesting, ids, hyperparameters and tensor values
    with safe_globals():
        rng, hf_rng = (torch.load(d / "rng_state.pth", weights_only=True) for d in (ours, theirs))
    assert torch.equal(rng["cpu"], hf_rng["cpu"]) and rng["python"] == hf_rng["python"]
    assert rng["numpy"][0] == hf_rng["numpy"][0] and (rng["numpy"][1] == hf_rng["numpy"][1]).all()
    assert rng["numpy"][2:] == hf_rng["numpy"][2:]
    state, hf_state = (json.loads((d / "trainer_state.json").read_text()) for d in (ours, theirs))
    assert state["global_step"] == hf_state["global_step"]
    assert state["log_history"] == hf_state["log_history"]  # the step's own log included


def test_damaged_newest_steps_are_skipped_then_saved_again_from_an_epoch_boundary(tmp_path: Path,
                                                                                  reference: dict) -> None:
    """Saves at epoch ends, after the epoch's evaluation; a resume from an epoch boundary."""
    root = tmp_path / "root"
    epochs = {"save_strategy": "epoch", "eval_strategy": "epoch", "evaluate": True}
    # an evaluation draws from the RNG (its DataLoader's base seed): the reference evaluates too
    uninterrupted = example.build_trainer(str(tmp_path / "ref"), [], **{**epochs, "save_strategy": "no"})
    uninterrupted.train()
    assert losses(uninterrupted.state.log_history) != reference["losses"]
    first = example.build_trainer(str(tmp_path / "out"), [make_callback(root), StopAt(10)], **epochs)
    first.train()
    assert committed(root) == [4, 8, 10]  # each epoch's end (4 steps), and where training stopped
    # saved after the step's evaluation, as the Trainer saves: its log and metrics are in the checkpoint
    history = json.loads(load(root, step=8)["trainer_state"]["json"])["log_history"]
    assert [h["step"] for h in history if "eval_loss" in h] == [4, 8]
    assert "eval_loss" in json.loads((root / "step-000000008" / "manifest.json").read_text())["metrics"]
    for step in (8, 10):
        model_file = next((root / f"step-{step:09d}").glob("TinyRegressor*"))
        data = bytearray(model_file.read_bytes())
        data[len(data) // 2] ^= 0xFF
        model_file.write_bytes(bytes(data))

    callback = make_callback(root)
    second = example.build_trainer(str(tmp_path / "out"), [callback], **epochs)
    with pytest.warns(RuntimeWarning) as record:
        path = callback.resume_checkpoint()
        assert callback.resumed_step == 4  # an epoch boundary: the Trainer restores RNG at the epoch's start
        second.train(resume_from_checkpoint=path)
    assert {"skipping step 10", "skipping step 8"} <= {m for w in record for m in
                                                       re.findall(r"skipping step \d+", str(w.message))}
    assert committed(root) == [4, 8, 12]  # 8 saved again by the resumed run; 10 moved aside
    assert len(list((root / ".checkpointd-damaged").iterdir())) == 2
    # every log but the final summary (train_loss averages the resumed steps only), timings aside
    assert untimed(second.state.log_history[:-1]) == untimed(uninterrupted.state.log_history[:-1])
    assert_same_weights(second.model.state_dict(), uninterrupted.model.state_dict())


def test_manager_schedule_preemption_and_bad_configurations(tmp_path: Path) -> None:
    # save_strategy="no": the manager's own schedule decides; a signal during step 8 saves step 8 and
    # ends training there
    class SignalAt(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == 7:
                os.kill(os.getpid(), signal.SIGUSR1)

    root = tmp_path / "own"
    callback = make_callback(root, every_n_steps=5, save_on_signals=(signal.SIGUSR1,))
    preempted = example.build_trainer(str(tmp_path / "out"), [callback, SignalAt()], save_strategy="no")
    preempted.train()
    assert preempted.state.global_step == 8 and committed(root) == [5, 8]

    with pytest.raises(ConfigError, match="save_strategy is 'no'"):
        example.build_trainer(str(tmp_path / "out"), [make_callback(tmp_path / "a")], save_strategy="no")
    with pytest.raises(ConfigError, match="save_strategy='best'"):
        example.build_trainer(str(tmp_path / "out"), [make_callback(tmp_path / "a")], save_strategy="best",
                              metric_for_best_model="loss")
    with pytest.raises(ConfigError, match=r"\['save_steps'\], which CheckpointManager does not take"):
        make_callback(tmp_path / "a", save_steps=3)
    with pytest.raises(ConfigError, match="needs the Trainer's arguments"):
        make_callback(root).resume_checkpoint()
    # a fresh start on a root with newer checkpoints would collide with them: refused, saying how to resume
    with pytest.raises(ConfigError, match=r"committed steps up to 8 and training starts at step 0: resume"):
        example.build_trainer(str(tmp_path / "out"), [make_callback(root, every_n_steps=5)],
                              save_strategy="no").train()
    # a root written by something else is not taken for a Trainer checkpoint
    other = tmp_path / "other"
    with CheckpointManager(other, {"model": torch.nn.Linear(2, 2)}, compression=None) as mgr:
        mgr.save(1)
    with pytest.raises(StateMismatchError, match=r"step 1 under .* has no entries \['optimizer'"):
        make_callback(other, resume_dir=tmp_path / "r").resume_checkpoint()


def test_example_killed_in_a_child_resumes_in_a_fresh_process(stalled_example: dict, reference: dict) -> None:
    """The example runs twice: SIGKILLed after step 6 committed, then resumed by a fresh process."""
    child, root, out = stalled_example["child"], stalled_example["root"], stalled_example["out"]
    deadline = time.monotonic() + 120
    while not (root / "step-000000006" / "COMMITTED").exists():
        assert child.poll() is None, stalled_example["log"].read_text()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint of step 6 committed"
        time.sleep(0.05)
    assert child.poll() is None  # still running (stalled at step 7): killed mid-run
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert committed(root) == [3, 6]

    done = subprocess.run(stalled_example["cmd"], env=stalled_example["env"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{\"")]
    assert lines[0] == {"resumed_from": 6}
    assert lines[-1]["global_step"] == TOTAL_STEPS
    assert lines[-1]["losses"] == [loss for _, loss in reference["losses"]]
    assert committed(root) == [9, 12]  # the example keeps the last 2
    assert_same_weights(load(root)["model"], reference["weights"])
    assert not list(out.glob("checkpoint-*")) and not (out / "checkpointd-resume").exists()
