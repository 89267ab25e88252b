"""The committer's pipeline on a :class:`SaveJob` (data): the named planning steps, the writer's hooks."""

from __future__ import annotations

import time

import pytest
import torch

from checkpointd import commit
from checkpointd.codecs.compress import get_codec
from checkpointd.format.manifest import Manifest
from checkpointd.save import planning
from checkpointd.save.job import SaveJob
from checkpointd.save.savejob import stage_save
from checkpointd.save.snapshot import Snapshotter
from checkpointd.save.writer import BackgroundWriter
from checkpointd.state import build_entries, build_files
from checkpointd.storage.store import Store


def _job(snap: Snapshotter, step: int) -> SaveJob:
    entries = build_entries({"model": torch.nn.Linear(4, 3)}, lambda m: False)
    files = build_files(entries, step, {}, {}, "")
    return stage_save(step=step, files=files, entries=entries, snapshotter=snap, metrics={}, mode="full",
                      world_size=1, codec_name="none", locations=None, extra={})


def test_a_save_runs_the_named_steps_then_the_hooks_in_order(tmp_path, monkeypatch) -> None:
    """``_process``: plan ahead, wait for the copies, clear the step directory, plan the rest, write,
    give the staging back, commit, ``on_commit``; ``after_save`` once the save committed."""
    calls: list[str] = []
    for name in ("wait_for_copies", "plan_files", "release_staging"):
        real = getattr(planning, name)

        def step(*args, _real=real, _name=name, **kw):
            calls.append(_name)
            return _real(*args, **kw)
        monkeypatch.setattr(planning, name, step)
    store = Store(str(tmp_path))

    def on_commit(job: SaveJob) -> None:
        assert commit.is_committed(store, job.step_dir)
        calls.append(f"on_commit {job.step}")

    writer = BackgroundWriter(store, get_codec(None), clear_step_dir=lambda d: calls.append(f"clear {d}"),
                              on_commit=on_commit, after_save=lambda: calls.append("after_save"))
    snap = Snapshotter()
    try:
        job = _job(snap, 3)
        assert job.sources and not job.files and job.failure is None  # nothing planned on the training thread
        assert writer.submit(job).result(timeout=60) is job
    finally:
        writer.close()
        snap.close()
    assert calls == ["plan_files", "wait_for_copies", f"clear {job.step_dir}", "plan_files", "release_staging",
                     "on_commit 3", "after_save"]
    assert len(job.files) == len(job.sources) and job.snapshotter is None  # staging given back once


def test_a_job_with_a_failure_fails_without_writing_or_hooks(tmp_path) -> None:
    """A job handed over with ``failure`` set (a rank's staging failed) raises it; nothing is cleared,
    written or committed, and no hook runs."""
    calls: list[str] = []
    store = Store(str(tmp_path))
    writer = BackgroundWriter(store, get_codec(None), clear_step_dir=lambda d: calls.append("clear"),
                              on_commit=lambda job: calls.append("on_commit"), after_save=lambda: calls.append("after_save"))
    error = RuntimeError("staging failed on this rank")
    manifest = Manifest(step=5, time=time.time(), world_size=1, mode="", codec="", library_version="", torch_version="")
    try:
        future = writer.submit(SaveJob(step=5, step_dir="step-000000005", manifest=manifest, failure=error))
        with pytest.raises(RuntimeError, match="staging failed on this rank"):
            future.result(timeout=60)
    finally:
        writer.close()
    assert calls == [] and not store.exists("step-000000005")
