"""Crash-consistency torture (see ``tests/torture_worker.py``): a process saving every step is SIGKILLed
at random moments, >= 50 times on local disk and a few times on S3; after every kill
``restore_latest()`` returns the newest committed step, bit-identical, with no partial and no lost
commit. ``benchmarks/torture.py`` runs the same for 500+ trials."""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from pathlib import Path

import pytest

import torture_worker as tw

N_LOCAL = int(os.environ.get("TORTURE_TRIALS", "50"))
"""Local kills in all (split over the two codecs); ``TORTURE_TRIALS`` raises it for a longer run."""


@pytest.fixture(scope="module")
def ctx():
    return tw.forkserver_context()


def _run(ctx, cfg: tw.TrialConfig, trials: int, seed: int, max_delay_secs: float = 0.3) -> list[tw.TrialResult]:
    rng = random.Random(seed)
    results = []
    for _ in range(trials):
        result = tw.run_trial(ctx, cfg, rng, max_delay_secs=max_delay_secs)
        assert result.ok, result
        results.append(result)
    return results


def test_tiny_state_roundtrip_is_deterministic():
    state = tw.build_state()
    tw.assign(state, 7)
    assert tw.mismatches(state, 7) == []
    assert tw.mismatches(state, 8) != []


@pytest.mark.parametrize("compression", ["zstd", None])
def test_sigkill_during_saves_local(ctx, tmp_path, compression):
    cfg = tw.TrialConfig(root=str(tmp_path / "ckpt"), log_path=str(tmp_path / "commits.log"), compression=compression)
    results = _run(ctx, cfg, N_LOCAL // 2, seed=1 if compression else 2)
    # the trials made progress and killed mid-run: many commits, and the chain kept advancing
    assert results[-1].latest is not None and results[-1].latest >= N_LOCAL // 4
    assert len(tw.logged_commits(cfg.log_path)) >= N_LOCAL // 4


def test_sigkill_during_saves_of_large_files_on_tmpfs(ctx, tmp_path):
    """Files large enough for recycling, blank files made ahead and the persist process's kept mappings
    (a 24 MiB tensor, uncompressed), on a memory file system where there is one: the paths the small
    state above never takes. The kills land in saves too (a longer delay: the child's first save waits
    for its persist process)."""
    shm = Path("/dev/shm")
    base = Path(tempfile.mkdtemp(dir=shm)) if shm.is_dir() and os.access(shm, os.W_OK) else tmp_path
    try:
        cfg = tw.TrialConfig(root=str(base / "ckpt"), log_path=str(tmp_path / "commits.log"), compression=None,
                             x_numel=24 << 18)
        results = _run(ctx, cfg, 12, seed=4, max_delay_secs=1.5)
        assert results[-1].latest is not None and len(tw.logged_commits(cfg.log_path)) >= 12
        # killed while the bin held retired or blank files: the large-file paths ran
        assert any(r.bin_files for r in results), [r.bin_files for r in results]
    finally:
        if base != tmp_path:
            shutil.rmtree(base, ignore_errors=True)


def test_sigkill_during_saves_s3(ctx, tmp_path, s3_root, s3_storage_options):
    cfg = tw.TrialConfig(root=s3_root, log_path=str(tmp_path / "commits.log"), storage_options=s3_storage_options)
    results = _run(ctx, cfg, 8, seed=3, max_delay_secs=0.6)
    assert results[-1].latest is not None
