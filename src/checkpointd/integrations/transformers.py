"""``CheckpointdCallback``: a Hugging Face ``Trainer`` that checkpoints through checkpointd and resumes exactly.

Usage (the user's code changes by two lines)::

    callback = CheckpointdCallback("s3://bucket/run-42", keep_last=3)
    args = TrainingArguments(..., save_strategy="steps", save_steps=500)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    trainer.train(resume_from_checkpoint=callback.resume_checkpoint())   # None: a fresh start

**Saving.** The callback takes over the Trainer's checkpoints: at every step where the Trainer would
save (``args.save_strategy`` ``"steps"``/``"epoch"``, ``save_steps``, and the final step with
``"steps"``), it calls :meth:`checkpointd.CheckpointManager.maybe_save` for ``state.global_step``
and clears ``control.should_save``, so the Trainer writes no ``checkpoint-N/`` directory and the
step costs milliseconds. The manager is built in ``on_train_begin``, once the Trainer created the
optimizer and LR scheduler; it registers the model, the optimizer, the scheduler, the GradScaler
(if the run has one), the RNG state and the ``TrainerState`` (as ``trainer_state.json`` text). A save
is taken after the step's log and evaluation, where the Trainer takes its own, so the stored
``log_history`` holds the step's loss. Retention, compression, storage and the rest are the
manager's keyword arguments, passed through. The manager's own schedule (``every_n_steps``,
``every_n_seconds``, ``at_steps``) adds saves; with ``save_strategy="no"`` it is the only one.
``save_on_signals=True`` saves at the next step after SIGTERM/SIGUSR1 and stops training there.
``on_train_end`` closes the manager: ``train()`` returns once every save is committed, and raises
``CheckpointWriteError`` if one failed.

**Resuming.** :meth:`CheckpointdCallback.resume_checkpoint` reads the newest committed step that
verifies (:func:`checkpointd.load`: checksums first, weights-only unpickling) and writes it out as a
Hugging Face checkpoint directory (``hf_layout.py``), under ``resume_dir`` (default
``<output_dir>/checkpointd-resume``). ``trainer.train(resume_from_checkpoint=...)`` then runs the
Trainer's own resume: same ``global_step``, the consumed batches skipped, RNG and ``TrainerState``
restored; a deterministic run continues as an uninterrupted one wherever the Trainer's own resume
does. The directory is deleted once the Trainer read it (at the first step, or at the end of training).

Limits: single-process training without DeepSpeed or FSDP (``args.world_size == 1``);
``save_strategy="best"`` and ``load_best_model_at_end`` need the Trainer's own checkpoints
(``keep_best=k, best_metric="eval_loss"`` keeps the best steps instead). As with the Trainer's own
resume, the logged losses match an uninterrupted run's when ``save_steps`` is a multiple of
``logging_steps`` (the loss accumulated since the last log is not state). The stored ``TrainerState``
holds ``TrainerControl``'s state, other stateful callbacks' states as at the start of training, and
``best_metric`` as before the step's own evaluation (the Trainer updates it after ``on_evaluate``).
"""

from __future__ import annotations

import inspect
import logging
import os
import shutil
import tempfile
import warnings
import weakref
from typing import Any

try:
    from accelerate.optimizer import AcceleratedOptimizer
    from transformers import TrainerCallback
except ImportError as exc:  # pragma: no cover - the integration's dependency
    raise ImportError("checkpointd.integrations.transformers needs transformers and accelerate: "
                      "pip install 'checkpointd[transformers]'") from exc

from checkpointd.errors import CheckpointError, ConfigError
from checkpointd.integrations import hf_layout
from checkpointd.manager import CheckpointManager
from checkpointd.rng import capture_rng, restore_rng

logger = logging.getLogger("checkpointd")

_SCHEDULE_OPTIONS = ("every_n_steps", "every_n_seconds", "at_steps")
_MANAGER_OPTIONS = frozenset(inspect.signature(CheckpointManager).parameters) - {"root", "state"}
_RESUME_PREFIX = "resume-"


class _TrainerStateEntry:
    """The ``TrainerState`` as ``trainer_state.json`` text, built only when a save happens.

    The Trainer reads ``trainer_state.json`` itself on resume, so loading puts nothing back here.
    """

    def __init__(self) -> None:
        self.state: Any = None
        self.control: Any = None

    def state_dict(self) -> dict[str, Any]:
        if self.state is None:  # the manager sizes its buffers before training has a state
            return {"json": "{}"}
        return {"json": hf_layout.trainer_state_json(self.state, self.control)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to apply: the Trainer loads ``trainer_state.json`` from the resume directory."""


class _RngEntry:
    """The RNG state at the save, in a form written out as the Trainer's ``rng_state.pth`` on resume.

    The Trainer restores it itself (after skipping the consumed batches), so loading puts nothing back.
    """

    def state_dict(self) -> dict[str, Any]:
        return capture_rng()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to apply: the Trainer loads ``rng_state.pth`` from the resume directory."""


class CheckpointdCallback(TrainerCallback):
    """Checkpoints a ``transformers.Trainer`` run through a :class:`checkpointd.CheckpointManager`.

    Args:
        root: checkpoint root, a local path or fsspec URL (``CheckpointManager``'s ``root``).
        resume_dir: local directory for the Hugging Face checkpoint that :meth:`resume_checkpoint`
            writes (default ``<args.output_dir>/checkpointd-resume``); it needs room for the model
            and optimizer state once.
        **manager_options: keyword arguments of :class:`checkpointd.CheckpointManager`
            (``keep_last``, ``keep_best``, ``best_metric``, ``compression``, ``storage_options``,
            ``local_dir``, ``save_on_signals``, ...). ``every_n_steps``/``every_n_seconds``/``at_steps``
            add saves to the Trainer's schedule. ``best_metric`` names a logged key (``"loss"``,
            ``"eval_loss"``): each save's metrics are the numbers the Trainer logged at that step.

    Raises:
        ConfigError: an argument ``CheckpointManager`` does not take.
    """

    def __init__(self, root: str | os.PathLike[str], *, resume_dir: str | os.PathLike[str] | None = None,
                 **manager_options: Any) -> None:
        unknown = sorted(set(manager_options) - _MANAGER_OPTIONS)
        if unknown:
            raise ConfigError(f"CheckpointdCallback got {unknown}, which CheckpointManager does not take "
                              f"(it takes {sorted(_MANAGER_OPTIONS)})")
        self.root = os.fspath(root)
        self.resume_dir = None if resume_dir is None else os.fspath(resume_dir)
        self.manager_options = manager_options
        self.manager: CheckpointManager | None = None
        """The run's manager, from ``on_train_begin`` until ``on_train_end`` closed it."""
        self.resumed_step: int | None = None
        """The step :meth:`resume_checkpoint` wrote out, or None."""
        self._args: Any = None
        self._trainer_state = _TrainerStateEntry()
        self._branched_from: int | None = None
        self._resume_tmp: str | None = None
        self._cleanup: Any = None
        self._pending: tuple[int, bool] | None = None
        self._last_saved: int | None = None
        self._last_train_log: int | None = None

    # ------------------------------------------------------------------------------------------
    # resuming
    # ------------------------------------------------------------------------------------------
    def resume_checkpoint(self) -> str | None:
        """Write the newest verified checkpoint as a Hugging Face ``checkpoint-<step>/`` directory.

        Pass the result to ``trainer.train(resume_from_checkpoint=...)``. Call it after the Trainer
        was built with this callback (it reads ``args.output_dir`` for the default ``resume_dir``).
        A newer step that fails verification is skipped with a warning; when training starts, such
        steps are moved aside (as ``CheckpointManager.restore_latest`` does) and the run saves them again.

        Returns:
            The directory's path, or None when the root holds no committed step (a fresh start).

        Raises:
            CorruptCheckpointError: committed steps exist but none verifies.
            StateMismatchError: the newest step was not written by this callback.
            ConfigError: no ``resume_dir`` and the callback has not seen the Trainer's arguments.
        """
        roots = [self.root]
        if self.manager_options.get("local_dir") is not None:
            roots.insert(0, os.fspath(self.manager_options["local_dir"]))
        saved = hf_layout.load_newest(roots, self.manager_options.get("storage_options"))
        self._remove_resume_dir()
        if saved is None:
            self.resumed_step = None
            return None
        parent = self._resume_parent()
        os.makedirs(parent, exist_ok=True)
        self._remove_stale(parent)
        self._resume_tmp = tempfile.mkdtemp(prefix=_RESUME_PREFIX, dir=parent)
        self._cleanup = weakref.finalize(self, shutil.rmtree, self._resume_tmp, True)
        path = hf_layout.write_checkpoint_dir(self._resume_tmp, saved)
        self.resumed_step = saved.step
        self._branched_from = saved.step if saved.skipped else None
        logger.info("checkpointd: step %d of %s written to %s for the Trainer's resume", saved.step, self.root, path)
        return path

    def _resume_parent(self) -> str:
        if self.resume_dir is not None:
            return self.resume_dir
        if self._args is None:
            raise ConfigError("CheckpointdCallback.resume_checkpoint() needs the Trainer's arguments: pass the "
                              "callback to Trainer(callbacks=[...]) first, or give CheckpointdCallback(resume_dir=...)")
        return os.path.join(self._args.output_dir, "checkpointd-resume")

    @staticmethod
    def _remove_stale(parent: str) -> None:
        """Leftovers of an earlier resume that was killed before the Trainer read them (ours by name)."""
        for name in os.listdir(parent):
            path = os.path.join(parent, name)
            if name.startswith(_RESUME_PREFIX) and os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)

    def _remove_resume_dir(self) -> None:
        if self._cleanup is not None:
            self._cleanup()  # shutil.rmtree, once
            self._cleanup = None
            parent = os.path.dirname(self._resume_tmp or "")
            self._resume_tmp = None
            try:
                os.rmdir(parent)  # only when empty
            except OSError:
                pass

    # ------------------------------------------------------------------------------------------
    # the Trainer's events
    # ------------------------------------------------------------------------------------------
    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._args = args
        _check_training_args(args, self.manager_options, warn=False)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       lr_scheduler: Any = None, **kwargs: Any) -> None:
        """Build the manager now that the Trainer created the optimizer and LR scheduler."""
        self._args = args
        _check_training_args(args, self.manager_options)
        if self.manager is not None:  # an earlier train() that raised: its saves are finished first
            self.manager.close()
        wrapped = isinstance(optimizer, AcceleratedOptimizer)
        inner = optimizer.optimizer if wrapped else optimizer  # the torch optimizer the Trainer's optimizer.pt holds
        entries: dict[str, Any] = {hf_layout.MODEL: model, hf_layout.OPTIMIZER: inner, hf_layout.SCHEDULER: lr_scheduler}
        scaler = optimizer.scaler if wrapped else None  # accelerate's GradScaler (fp16), the Trainer's scaler.pt
        if scaler is not None:
            entries[hf_layout.SCALER] = scaler
        entries[hf_layout.TRAINER_STATE] = self._trainer_state
        entries[hf_layout.RNG] = _RngEntry()
        self._trainer_state.state, self._trainer_state.control = state, control
        self.manager = CheckpointManager(self.root, entries, **self.manager_options)
        self._pending = None
        self._last_saved = state.global_step if state.global_step > 0 else None
        self._last_train_log = state.global_step
        branched, self._branched_from = self._branched_from, None
        if branched is not None and branched == state.global_step:
            self._mark_branch(branched)
        elif not self.manager_options.get("overwrite"):
            self._check_fresh(state.global_step)

    def _check_fresh(self, step: int) -> None:
        """Refuse a run that would save over newer committed steps (a restart without resuming)."""
        latest = self.manager.latest_step()  # type: ignore[union-attr]
        if latest is not None and latest > step:
            manager, self.manager = self.manager, None
            manager.close()  # type: ignore[union-attr]
            raise ConfigError(
                f"{self.root} holds committed steps up to {latest} and training starts at step {step}: resume "
                "with trainer.train(resume_from_checkpoint=callback.resume_checkpoint()), or give the callback "
                "a new root (or overwrite=True to replace those steps)"
            )

    def _mark_branch(self, step: int) -> None:
        """Newer committed steps failed verification: ``restore_latest()`` (which restores ``step``, the
        values the Trainer just loaded) moves them aside, so this run saves those steps again. The RNG
        is left as the Trainer has it; the Trainer restores it after skipping the consumed batches."""
        rng = capture_rng()
        restored = self.manager.restore_latest()  # type: ignore[union-attr]
        restore_rng(rng)
        if restored != step:
            raise CheckpointError(f"{self.root} changed during the resume: its newest verified step is {restored}, "
                                  f"the Trainer resumed from {step}; is another job writing this root?")

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._flush(state, control)  # a step whose log or evaluation never came (see _defer)
        self._remove_resume_dir()  # the Trainer has read it: RNG last, before this event

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._defer(state, control)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._defer(state, control)

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if isinstance(logs, dict) and "loss" in logs:
            self._last_train_log = state.global_step
        if not control.should_evaluate:  # an evaluation's own log comes before on_evaluate
            self._flush(state, control)

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._flush(state, control)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Save a step still pending, then close the manager: every started save is committed on return."""
        self._flush(state, control)
        self._remove_resume_dir()
        manager, self.manager = self.manager, None
        if manager is not None:
            manager.close()

    # ------------------------------------------------------------------------------------------
    # saving
    # ------------------------------------------------------------------------------------------
    def _defer(self, state: Any, control: Any) -> None:
        """Take over a save the Trainer scheduled, and save once the step's log and evaluation are done.

        The Trainer logs and evaluates after ``on_step_end``/``on_epoch_end`` and saves last; saving at
        the same point keeps the step's log in ``log_history`` and the RNG as the Trainer would store it.
        """
        due = bool(control.should_save)
        control.should_save = False  # the Trainer writes no checkpoint-N/: this step is saved here
        if self._pending is not None and self._pending[0] == state.global_step:
            due = due or self._pending[1]
        self._pending = (state.global_step, due)
        logs_next = control.should_log and state.global_step != self._last_train_log
        if not (logs_next or control.should_evaluate):
            self._flush(state, control)

    def _flush(self, state: Any, control: Any) -> None:
        if self._pending is None or self.manager is None:
            return
        step, due = self._pending
        self._pending = None
        if step == self._last_saved:
            return
        self._trainer_state.state, self._trainer_state.control = state, control
        if self.manager.maybe_save(step, metrics=hf_layout.step_metrics(state.log_history, step), force=due):
            self._last_saved = step
        if self.manager.preempted:
            control.should_training_stop = True


def _check_training_args(args: Any, manager_options: dict[str, Any], warn: bool = True) -> None:
    """Refuse ``TrainingArguments`` this callback cannot serve, naming the argument and what to do;
    with ``warn``, also say which arguments it ignores.

    Raises:
        ConfigError: a save strategy or option that needs the Trainer's own checkpoints, or no schedule.
    """
    strategy = str(getattr(args.save_strategy, "value", args.save_strategy))
    if strategy == "best":
        raise ConfigError("CheckpointdCallback does not serve save_strategy='best' (it needs the Trainer's own "
                          "checkpoints): use save_strategy='steps' with keep_best=k, best_metric='eval_loss'")
    if getattr(args, "load_best_model_at_end", False):
        raise ConfigError("CheckpointdCallback replaces the Trainer's checkpoints, which load_best_model_at_end "
                          "reads: set load_best_model_at_end=False (keep_best=k, best_metric=... keeps the best steps)")
    has_schedule = any(manager_options.get(k) not in (None, (), []) for k in _SCHEDULE_OPTIONS)
    if strategy == "no" and not has_schedule and not manager_options.get("save_on_signals"):
        raise ConfigError("CheckpointdCallback saves on the Trainer's schedule, and save_strategy is 'no': set "
                          "save_strategy='steps' and save_steps=N, or give the callback every_n_steps=N")
    if getattr(args, "world_size", 1) > 1:
        raise ConfigError(f"CheckpointdCallback serves single-process training; this run has world_size="
                          f"{args.world_size}: use the Trainer's own checkpoints there")
    if getattr(args, "deepspeed", None) or getattr(args, "fsdp", None):
        raise ConfigError("CheckpointdCallback does not serve DeepSpeed or FSDP runs (their resume reads the engine's "
                          "own checkpoint files): use the Trainer's own checkpoints there")
    if warn and getattr(args, "save_total_limit", None):
        warnings.warn("CheckpointdCallback: save_total_limit is ignored; retention is the callback's keep_last "
                      "(and keep_every_n_steps, keep_best)", UserWarning, stacklevel=3)


__all__ = ["CheckpointdCallback"]
