"""A Hugging Face ``checkpoint-N/`` directory built from a verified checkpointd step, for the Trainer's own resume.

:class:`checkpointd.integrations.transformers.CheckpointdCallback` saves the Trainer's state through a
:class:`checkpointd.CheckpointManager` under these entry names (:data:`ENTRIES`). To resume, the newest
committed step that verifies is read with :func:`checkpointd.load` (every file checked against its
manifest, every pickle through the weights-only unpickler) and written out as the files the Trainer's
``train(resume_from_checkpoint=...)`` reads: ``_load_from_checkpoint`` (``model.safetensors``, or
``pytorch_model.bin`` for a state dict that holds more than tensors), ``_load_optimizer_and_scheduler``
(``optimizer.pt``, ``scheduler.pt``), ``_load_scaler`` (``scaler.pt``), ``_load_rng_state``
(``rng_state.pth``) and ``TrainerState.load_from_json`` (``trainer_state.json``). So the Trainer skips
the consumed batches, restores RNG and ``TrainerState`` exactly as after its own checkpoints, and its
loaders read only files written here from verified values.

Single-process runs (``args.world_size == 1``): the Trainer reads one ``rng_state.pth``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np
import safetensors.torch
import torch
from transformers.trainer import OPTIMIZER_NAME, SCALER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import SAFE_WEIGHTS_NAME, WEIGHTS_NAME

from checkpointd import commit
from checkpointd.errors import NOT_VERIFIED, CorruptCheckpointError, StateMismatchError
from checkpointd.load import load
from checkpointd.rng import check_rng
from checkpointd.storage.store import Store


MODEL = "model"
OPTIMIZER = "optimizer"
SCHEDULER = "scheduler"
SCALER = "scaler"
TRAINER_STATE = "trainer_state"
RNG = "rng"
ENTRIES = (MODEL, OPTIMIZER, SCHEDULER, SCALER, TRAINER_STATE, RNG)
"""The state names the callback registers; ``scaler`` only when the run has a GradScaler."""
REQUIRED = (MODEL, OPTIMIZER, SCHEDULER, TRAINER_STATE, RNG)
RNG_FILE = "rng_state.pth"
"""What ``Trainer._load_rng_state`` reads in a single-process run."""


@dataclass
class VerifiedStep:
    """The newest committed step that verified, as plain values (CPU tensors)."""

    step: int
    values: dict[str, Any]
    """``{entry name: stored value}``, from :func:`checkpointd.load`."""
    skipped: list[int] = field(default_factory=list)
    """Newer committed steps that failed verification (the run branches from ``step``)."""


def load_newest(roots: list[str], storage_options: dict[str, Any] | None) -> VerifiedStep | None:
    """The newest committed step under any of ``roots`` that verifies; None when none holds a committed step.

    A newer step that fails verification is skipped with a warning, as ``restore_latest`` does. With two
    tiers, ``roots`` is ``[local_dir, root]`` and a step is read from the first root that holds it.

    Raises:
        CorruptCheckpointError: committed steps exist but none verifies (never a silent fresh start).
    """
    where: dict[int, list[str]] = {}
    for root in roots:
        options = storage_options if root == roots[-1] else None  # storage_options belong to `root`
        for step in commit.committed_steps(Store(root, options)):
            where.setdefault(step, []).append(root)
    skipped: list[int] = []
    failures: list[str] = []
    for step in sorted(where, reverse=True):
        for root in where[step]:
            try:
                values = load(root, step=step, storage_options=storage_options if root == roots[-1] else None)
            except NOT_VERIFIED as exc:
                warnings.warn(f"checkpointd: skipping step {step} under {root}, it does not verify: {exc}",
                              RuntimeWarning, stacklevel=3)
                failures.append(f"step {step} under {root}: {exc}")
                continue
            check_entries(values, step, root)
            return VerifiedStep(step=step, values=values, skipped=sorted(set(skipped) - {step}))
        skipped.append(step)
    if not where:
        return None
    raise CorruptCheckpointError(
        f"{roots[-1]} holds {len(where)} committed step(s) but none verifies: " + "; ".join(failures[:5])
    )


def check_entries(values: Mapping[str, Any], step: int, root: str) -> None:
    """Raise StateMismatchError unless ``values`` holds what the callback saves, in the expected form."""
    missing = [name for name in REQUIRED if name not in values]
    if missing:
        raise StateMismatchError(
            f"step {step} under {root} has no entries {missing} (it has {sorted(values)}): it was not written by "
            "CheckpointdCallback; resume it with the code that wrote it, or give the callback a new root"
        )
    for name in (MODEL, OPTIMIZER, SCHEDULER, RNG):
        if not isinstance(values[name], dict):
            raise StateMismatchError(f"step {step} under {root}: entry {name!r} is a {type(values[name]).__name__}, "
                                     "not a state dict")
    text = values[TRAINER_STATE].get("json") if isinstance(values[TRAINER_STATE], dict) else None
    try:
        state = json.loads(text) if isinstance(text, str) else None
    except ValueError:
        state = None
    if not isinstance(state, dict) or state.get("global_step") != step:
        raise StateMismatchError(f"step {step} under {root}: entry {TRAINER_STATE!r} is not the JSON of a "
                                 f"TrainerState at global_step {step}")
    try:
        check_rng(values[RNG])
    except (TypeError, ValueError, RuntimeError, KeyError, IndexError) as exc:
        raise StateMismatchError(f"step {step} under {root}: entry {RNG!r} is not an RNG state ({exc})") from exc


def write_checkpoint_dir(parent: str, saved: VerifiedStep) -> str:
    """Write ``<parent>/checkpoint-<step>/`` for ``Trainer.train(resume_from_checkpoint=...)``; returns its path.

    ``parent`` must be a directory this process created and owns: nothing is written anywhere else.
    """
    values = saved.values
    out = os.path.join(parent, f"{PREFIX_CHECKPOINT_DIR}-{saved.step}")
    os.makedirs(out)
    write_model_weights(out, values[MODEL])
    torch.save(values[OPTIMIZER], os.path.join(out, OPTIMIZER_NAME))
    torch.save(values[SCHEDULER], os.path.join(out, SCHEDULER_NAME))
    if isinstance(values.get(SCALER), dict):
        torch.save(values[SCALER], os.path.join(out, SCALER_NAME))
    torch.save(hf_rng_state(values[RNG]), os.path.join(out, RNG_FILE))
    with open(os.path.join(out, TRAINER_STATE_NAME), "w", encoding="utf-8") as f:
        f.write(values[TRAINER_STATE]["json"])
    return out


def write_model_weights(out: str, state_dict: dict[str, Any]) -> None:
    """``model.safetensors`` when every value is a tensor, else ``pytorch_model.bin`` (both read by the Trainer).

    safetensors refuses tensors that share memory; the ones that do (tied weights, views of one read
    buffer) are cloned, which loads the same values into the same parameters.
    """
    if not all(isinstance(v, torch.Tensor) for v in state_dict.values()):
        torch.save(state_dict, os.path.join(out, WEIGHTS_NAME))
        return
    seen: set[int] = set()
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        ptr = tensor.untyped_storage().data_ptr()
        shared = ptr in seen and tensor.numel() > 0
        seen.add(ptr)
        tensors[name] = tensor.clone() if shared or not tensor.is_contiguous() else tensor
    safetensors.torch.save_file(tensors, os.path.join(out, SAFE_WEIGHTS_NAME), metadata={"format": "pt"})


def hf_rng_state(rng: dict[str, Any]) -> dict[str, Any]:
    """checkpointd's RNG capture (``checkpointd.rng.capture_rng``, checked by ``check_rng``) in the form
    ``Trainer._save_rng_state`` writes in a single-process run (CUDA: the current device's state)."""
    out: dict[str, Any] = {}
    if "python" in rng:
        version, internal, gauss = rng["python"]
        out["python"] = (int(version), tuple(int(x) for x in internal), gauss)
    if "numpy" in rng:
        kind, keys, pos, has_gauss, cached = rng["numpy"]
        out["numpy"] = (str(kind), keys.numpy().astype(np.uint32), int(pos), int(has_gauss), float(cached))
    out["cpu"] = rng["torch"]
    if rng.get("cuda"):
        cuda = list(rng["cuda"])
        index = torch.cuda.current_device() if torch.cuda.is_available() else 0
        out["cuda"] = cuda[min(index, len(cuda) - 1)]
    return out


def trainer_state_json(state: Any, control: Any) -> str:
    """The ``trainer_state.json`` text ``TrainerState.save_to_json`` writes, with the control's current state.

    Built from a copy: the live ``TrainerState`` is not changed. The Trainer records other stateful
    callbacks (``ExportableState``) from objects a callback cannot reach; their entries are the ones in
    ``state`` (as at the start of training).
    """
    data = dataclasses.asdict(state)
    callbacks = data.get("stateful_callbacks")
    if isinstance(callbacks, dict) and type(control).__name__ in callbacks and hasattr(control, "state"):
        callbacks[type(control).__name__] = control.state()
    return json.dumps(data, indent=2, sort_keys=True) + "\n"


def step_metrics(log_history: list[dict[str, Any]], step: int) -> dict[str, float]:
    """The numbers logged at ``step`` (``loss``, ``eval_loss``, ...), merged, for ``keep_best``/``best_metric``."""
    merged: dict[str, float] = {}
    for entry in reversed(log_history):
        if entry.get("step") != step:
            if isinstance(entry.get("step"), int) and entry["step"] < step:
                break
            continue
        for key, value in entry.items():
            if key not in merged and key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                merged[key] = float(value)
    return merged


__all__ = [
    "ENTRIES",
    "MODEL",
    "OPTIMIZER",
    "RNG",
    "SCALER",
    "SCHEDULER",
    "TRAINER_STATE",
    "VerifiedStep",
    "check_entries",
    "hf_rng_state",
    "load_newest",
    "step_metrics",
    "trainer_state_json",
    "write_checkpoint_dir",
    "write_model_weights",
]
