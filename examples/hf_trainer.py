"""A Hugging Face ``Trainer`` run that checkpoints through checkpointd and resumes where it stopped.

    python examples/hf_trainer.py --stall-at 7    # saves at steps 3 and 6, then stops making progress:
                                                  # kill it (Ctrl-C, kill -9), as a preemption would
    python examples/hf_trainer.py                 # resumes from the newest committed step, finishes

Runs in seconds on a CPU. The two lines that matter: the callback in ``Trainer(callbacks=[...])`` (it
saves on the Trainer's ``save_strategy``/``save_steps`` schedule, instead of the Trainer's
``checkpoint-N/`` directories) and ``trainer.train(resume_from_checkpoint=callback.resume_checkpoint())``
(the newest verified checkpoint as a Hugging Face checkpoint directory, or None for a fresh start).
The resumed run continues at the same step and data position, with the same losses and weights as a
run that was never stopped.
"""

from __future__ import annotations

import argparse
import json
import threading
from typing import Any

import torch
import torch.nn as nn
from transformers import PretrainedConfig, PreTrainedModel, Trainer, TrainerCallback, TrainingArguments

from checkpointd.integrations.transformers import CheckpointdCallback


class TinyConfig(PretrainedConfig):
    model_type = "checkpointd-tiny-regressor"

    def __init__(self, n_in: int = 4, hidden: int = 8, dropout: float = 0.2, **kwargs: Any) -> None:
        self.n_in, self.hidden, self.dropout = n_in, hidden, dropout
        super().__init__(**kwargs)


class TinyRegressor(PreTrainedModel):
    """Two linear layers with dropout (so the resumed run needs the RNG back) and an MSE loss."""

    config_class = TinyConfig

    def __init__(self, config: TinyConfig) -> None:
        super().__init__(config)
        self.inp = nn.Linear(config.n_in, config.hidden)
        self.drop = nn.Dropout(config.dropout)
        self.out = nn.Linear(config.hidden, 1)
        self.post_init()

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        pred = self.out(self.drop(torch.relu(self.inp(x)))).squeeze(-1)
        result = {"logits": pred}
        if labels is not None:
            result["loss"] = nn.functional.mse_loss(pred, labels)
        return result


def make_dataset(n: int = 16, n_in: int = 4) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, n_in, generator=g)
    y = x.sum(dim=1) + 0.1 * torch.randn(n, generator=g)
    return [{"x": x[i], "labels": y[i]} for i in range(n)]


def training_args(output_dir: str, **overrides: Any) -> TrainingArguments:
    """Deterministic CPU arguments: 16 samples, batch 4, 3 epochs (12 steps), a save every 3 steps."""
    kwargs: dict[str, Any] = dict(
        output_dir=output_dir, use_cpu=True, report_to=[], seed=1, data_seed=2, dataloader_num_workers=0,
        per_device_train_batch_size=4, num_train_epochs=3, learning_rate=1e-2, warmup_steps=2,
        logging_steps=1, save_strategy="steps", save_steps=3, disable_tqdm=True,
    )
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def build_trainer(output_dir: str, callbacks: list[TrainerCallback], evaluate: bool = False,
                  **overrides: Any) -> Trainer:
    """The same model (seeded), data and arguments on every call; ``evaluate`` adds 8 evaluation samples."""
    torch.manual_seed(0)
    model = TinyRegressor(TinyConfig())
    return Trainer(model=model, args=training_args(output_dir, **overrides), train_dataset=make_dataset(),
                   eval_dataset=make_dataset(8) if evaluate else None, callbacks=callbacks)


class StallAt(TrainerCallback):
    """Stops making progress after ``step`` (a stuck job), so the run can be killed mid-training."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            print(json.dumps({"stalled_at": state.global_step}), flush=True)
            threading.Event().wait()


def main(argv: list[str] | None = None) -> Trainer:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default="runs/hf_trainer", help="checkpoint root: a path or fsspec URL")
    ap.add_argument("--output-dir", default="runs/hf_trainer_out", help="the Trainer's output_dir")
    ap.add_argument("--stall-at", type=int, default=None, help="stop making progress at this step (then kill it)")
    args = ap.parse_args(argv)

    callback = CheckpointdCallback(args.root, keep_last=2, compression="zstd")
    callbacks: list[TrainerCallback] = [callback]
    if args.stall_at is not None:
        callbacks.append(StallAt(args.stall_at))
    trainer = build_trainer(args.output_dir, callbacks)
    resume = callback.resume_checkpoint()  # None on a fresh root
    print(json.dumps({"resumed_from": callback.resumed_step}), flush=True)
    trainer.train(resume_from_checkpoint=resume)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    print(json.dumps({"global_step": trainer.state.global_step, "losses": losses}), flush=True)
    return trainer


if __name__ == "__main__":
    main()
