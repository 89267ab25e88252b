"""On-disk names: step directories, file names, the manifest and the commit marker.

Every name the library writes or parses lives here, so the storage layout of SPEC §3 can be read in
one place. File names follow PhysicsNeMo's ``{ClassName}{id}.{mp_rank}.{step}.{ext}`` convention so an
uncompressed step directory is also a PhysicsNeMo checkpoint directory.
"""

from __future__ import annotations

import re

STEP_DIR_PREFIX = "step-"
STEP_DIGITS = 9
MANIFEST_NAME = "manifest.json"
COMMIT_MARKER_NAME = "COMMITTED"
TRAINING_STATE_STEM = "checkpoint"
ZSTD_SUFFIX = ".zst"
MP_RANK = 0
"""PhysicsNeMo's model-parallel rank component of file names; checkpointd always writes 0."""

_STEP_DIR_RE = re.compile(rf"{re.escape(STEP_DIR_PREFIX)}([0-9]{{{STEP_DIGITS},{STEP_DIGITS + 9}}})")
"""ASCII digits only (``re``'s ``\\d`` also matches other scripts' digits), at most 18 of them."""


def step_dir_name(step: int) -> str:
    """``step-000001000`` for step 1000."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"{STEP_DIR_PREFIX}{step:0{STEP_DIGITS}d}"


def parse_step_dir_name(name: str) -> int | None:
    """The step of a step directory's base name, or ``None`` for any other name.

    Only the canonical name counts (``step_dir_name(step) == name``): ``step-0000000100`` is not a
    second name for step 100, so every listed step is read from the directory it was listed under.
    """
    base = name.rstrip("/").rsplit("/", 1)[-1]
    match = _STEP_DIR_RE.fullmatch(base)
    if match is None:
        return None
    step = int(match.group(1))
    return step if step_dir_name(step) == base else None


def model_file_name(stem: str, step: int, ext: str, codec_suffix: str = "") -> str:
    """``FullyConnected.0.1000.mdlus`` (``stem`` already carries the id when a class repeats)."""
    return f"{stem}.{MP_RANK}.{step}.{ext}{codec_suffix}"


def training_state_file_name(step: int, codec_suffix: str = "") -> str:
    """``checkpoint.0.1000.pt``: optimizer, scheduler, scaler, epoch, metadata and other state."""
    return f"{TRAINING_STATE_STEM}.{MP_RANK}.{step}.pt{codec_suffix}"


def join(root: str, *parts: str) -> str:
    """Join path parts with '/', for local paths and URLs alike."""
    out = root.rstrip("/")
    for part in parts:
        out = f"{out}/{part.strip('/')}"
    return out
