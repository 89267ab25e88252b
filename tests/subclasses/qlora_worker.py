"""Child process of ``test_qlora_crash.py``: QLoRA training with checkpointd, killed or resumed.

``python qlora_worker.py ROOT OUT STEPS [STALL_AT]``: restores the newest committed step of ROOT (if
any), trains to STEPS with a ``maybe_save`` every 2 steps, then saves the final LoRA weights,
optimizer state and NF4 inner tensors to OUT. With STALL_AT, it stops after that step (its
checkpoint committed, one more step trained) and waits to be killed.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from checkpointd import CheckpointManager  # noqa: E402
from tests.subclasses.quantized_models import qlora_model, run_qlora  # noqa: E402


def main(root: str, out: str, steps: int, stall_at: int | None) -> None:
    model = qlora_model(0)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    with CheckpointManager(root, {"model": model, "opt": opt}, every_n_steps=2, compression=None) as mgr:
        start = mgr.restore_latest() or 0

        def after(step: int) -> None:
            mgr.maybe_save(step + 1)
            if stall_at is not None and step == stall_at:  # step 7 trained, step 6 committed
                mgr.wait()
                print(f"stalled after step {step + 1}", flush=True)
                time.sleep(120)  # killed here

        run_qlora(model, opt, range(start, steps), after)
    torch.save(final_state(model, opt), out)


def final_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    return {"model": model.state_dict(), "opt": opt.state_dict()}


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) > 4 else None)
