"""Lightning with checkpointd: background checkpoints through ``CheckpointdIO``, resumable with ``ckpt_path="last"``.

    python examples/lightning_trainer.py --dir /tmp/lightning-run --steps 24 --kill-at 20   # SIGKILLed at step 20 ...
    python examples/lightning_trainer.py --dir /tmp/lightning-run --steps 24                # ... resumes at 16, ends at 24

``ModelCheckpoint`` decides what is kept (here the two lowest losses and ``last.ckpt``, every epoch's
end); ``CheckpointdIO`` snapshots each checkpoint and returns, writes it in the background under
``<dir>/ckpt/.checkpointd`` (committed with a marker written last, verified on load), and puts a small
pointer file at each path ModelCheckpoint names. Killing the run at any moment loses nothing older
than the newest committed checkpoint, and the resumed run continues exactly like an uninterrupted one.
Runs in seconds on a CPU.
"""

from __future__ import annotations

import argparse
import os
import signal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from checkpointd.integrations.lightning import CheckpointdIO

BATCHES = 8
"""Batches per epoch; checkpoints at epoch ends (a plain DataLoader resumes exactly there)."""


class Regressor(pl.LightningModule):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.GELU(), torch.nn.Linear(width, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)

    def on_train_start(self) -> None:
        print(f"started at global step {self.trainer.global_step}", flush=True)


def data() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16 * BATCHES, 8, generator=g)
    y = x.sum(dim=1, keepdim=True).sin()
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)


class KillAt(pl.Callback):
    """Simulates a crash: SIGKILL at the start of global step ``step`` (saves may be in flight)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.global_step == self.step:
            print(f"killed at global step {self.step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def train(run_dir: str, steps: int, kill_at: int | None = None) -> tuple[pl.Trainer, Regressor, ModelCheckpoint]:
    """Train to global step ``steps``, resuming from ``run_dir/ckpt/last.ckpt`` when it exists."""
    pl.seed_everything(0, verbose=False)
    checkpoints = ModelCheckpoint(dirpath=os.path.join(run_dir, "ckpt"), every_n_train_steps=BATCHES,
                                  save_top_k=2, monitor="train_loss", save_last=True)
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, deterministic=True, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=run_dir,
                         callbacks=[checkpoints] + ([KillAt(kill_at)] if kill_at is not None else []),
                         plugins=[CheckpointdIO()])
    model = Regressor()
    trainer.fit(model, data(), ckpt_path="last")  # teardown waits for the last save to commit
    return trainer, model, checkpoints


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="/tmp/checkpointd-lightning", help="run directory (checkpoints in DIR/ckpt)")
    p.add_argument("--steps", type=int, default=24, help="train to this global step")
    p.add_argument("--kill-at", type=int, default=None, help="simulate a crash (SIGKILL) at this global step")
    args = p.parse_args()
    trainer, _, checkpoints = train(args.dir, args.steps, args.kill_at)
    print(f"finished at global step {trainer.global_step}; best {os.path.basename(checkpoints.best_model_path)}, "
          f"last {os.path.basename(checkpoints.last_model_path)}", flush=True)


if __name__ == "__main__":
    main()
