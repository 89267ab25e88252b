"""A Python interpreter with the real PhysicsNeMo, for interop tests run through subprocesses.

PhysicsNeMo is never a dependency of checkpointd, so it lives in a venv of its own (the "core tier" of
``nvidia-physicsnemo==2.2.2`` on the CPU torch, recipe in shared/PHYSICSNEMO.md). The fixture
:func:`physicsnemo_python` finds or builds it once per machine:

1. ``CHECKPOINTD_PHYSICSNEMO_PYTHON`` names an interpreter to use as is (it must work);
2. else the cached venv under ``~/.cache/checkpointd-tests/pnvenv`` (``$XDG_CACHE_HOME`` respected) is
   reused if its ready marker exists and it imports PhysicsNeMo;
3. else it is (re)built there, under a file lock so parallel test processes build it only once.

Outside CI a failed build skips the interop tests (no network, say); in CI (``CI`` set) it fails them,
so a broken install can never pass as a green run.

Import the fixture into a test module with ``from physicsnemo_env import physicsnemo_python``.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

PHYSICSNEMO_PYTHON_ENV = "CHECKPOINTD_PHYSICSNEMO_PYTHON"
PHYSICSNEMO_VERSION = "2.2.2"
TORCH_VERSION = "2.13.0"
CORE_TIER_DEPS = (
    "warp-lang",
    "packaging",
    "requests",
    "s3fs",
    "tqdm",
    "treelib",
    "tensordict",
    "termcolor",
    "GitPython",
)
"""What ``physicsnemo.core`` and ``physicsnemo.utils.checkpoint`` import (PHYSICSNEMO.md)."""

BUILD_TIMEOUT_SECS = 1200
PROBE_TIMEOUT_SECS = 120
READY_MARKER = ".checkpointd-ready"
"""Written last by a build, so a build killed halfway is never reused."""

SCRIPTS_DIR = Path(__file__).parent / "pn_scripts"
"""Scripts run inside the PhysicsNeMo venv."""

_QUICK_PROBE = (
    "import importlib.metadata as m, importlib.util as u; "
    "assert u.find_spec('physicsnemo') and u.find_spec('torch'), 'physicsnemo or torch missing'; "
    "print(m.version('nvidia-physicsnemo'))"
)
"""Reads package metadata only (importing PhysicsNeMo takes seconds): decides whether a venv is reused."""
_FULL_PROBE = (
    "import importlib.metadata as m, physicsnemo.core, physicsnemo.utils.checkpoint; "
    "print(m.version('nvidia-physicsnemo'))"
)
"""Imports what the tests use; run once on a freshly built venv."""


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


@pytest.fixture(scope="session")
def physicsnemo_python() -> Path:
    """Path of a ``python`` that imports the real PhysicsNeMo 2.2.2 (core tier)."""
    explicit = os.environ.get(PHYSICSNEMO_PYTHON_ENV)
    if explicit:
        python = Path(explicit)
        problem = _probe(python)
        if problem:
            pytest.fail(f"{PHYSICSNEMO_PYTHON_ENV}={explicit} does not import PhysicsNeMo: {problem}")
        return python
    try:
        return ensure_physicsnemo_venv(default_venv_dir())
    except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
        message = f"could not build the PhysicsNeMo venv: {exc}"
        if in_ci():
            pytest.fail(message)
        pytest.skip(f"{message} (set {PHYSICSNEMO_PYTHON_ENV} to a python with nvidia-physicsnemo=={PHYSICSNEMO_VERSION})")


def default_venv_dir() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "checkpointd-tests" / "pnvenv"


def ensure_physicsnemo_venv(venv_dir: Path) -> Path:
    """The venv's python, building the venv first unless a complete, working one is there."""
    venv_dir.parent.mkdir(parents=True, exist_ok=True)
    python = venv_dir / "bin" / "python"
    with open(venv_dir.parent / (venv_dir.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another xdist worker may be building it right now
        if (venv_dir / READY_MARKER).exists() and _probe(python) is None:
            return python
        _build_venv(venv_dir)
        problem = _probe(python, _FULL_PROBE)
        if problem:
            raise RuntimeError(f"the fresh venv at {venv_dir} does not import PhysicsNeMo: {problem}")
        (venv_dir / READY_MARKER).write_text(f"nvidia-physicsnemo=={PHYSICSNEMO_VERSION}\n")
    return python


def _build_venv(venv_dir: Path) -> None:
    """PHYSICSNEMO.md's recipe: CPU torch pinned, PhysicsNeMo without its (GPU-heavy) deps, core deps."""
    shutil.rmtree(venv_dir, ignore_errors=True)
    started = time.monotonic()
    _check_call([sys.executable, "-m", "venv", str(venv_dir)])
    pins = venv_dir / "pins.txt"
    pins.write_text(f"torch=={TORCH_VERSION}\n")
    pip = [str(venv_dir / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    _check_call([*pip, "-c", str(pins), f"torch=={TORCH_VERSION}"])
    _check_call([*pip, "--no-deps", f"nvidia-physicsnemo=={PHYSICSNEMO_VERSION}"])
    _check_call([*pip, "-c", str(pins), *CORE_TIER_DEPS])
    print(f"built the PhysicsNeMo venv at {venv_dir} in {time.monotonic() - started:.0f} s", file=sys.stderr)


def _check_call(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_SECS)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def _probe(python: Path, code: str = _QUICK_PROBE) -> str | None:
    """None if ``python`` imports PhysicsNeMo's checkpoint code at the pinned version, else why not."""
    if not python.exists():
        return f"{python} does not exist"
    try:
        out = run_in_physicsnemo(python, code, timeout=PROBE_TIMEOUT_SECS).strip()
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    version = out.splitlines()[-1] if out else ""
    if version != PHYSICSNEMO_VERSION:
        return f"it has nvidia-physicsnemo {version or '?'}, tests need {PHYSICSNEMO_VERSION}"
    return None


def run_in_physicsnemo(python: Path | str, script: Path | str, *args: str, timeout: float = 120) -> str:
    """Run a script file (a ``Path``) or code (a ``str``) with the PhysicsNeMo python; return its stdout.

    The script's folder (or ``tests/pn_scripts`` for code) is on ``sys.path``, so model classes defined in
    ``tests/pn_scripts`` resolve by their ``__module__`` as ``Module.from_checkpoint`` needs. It runs in a
    temporary folder that also holds Warp's and PhysicsNeMo's caches (never the user's home), so pass
    absolute paths.

    Raises:
        RuntimeError: the script exited non-zero; the message holds its stderr.
    """
    if isinstance(script, Path):
        cmd, path_dir = [str(python), str(script), *args], script.parent
    else:
        cmd, path_dir = [str(python), "-c", script, *args], SCRIPTS_DIR
    with tempfile.TemporaryDirectory(prefix="checkpointd-pn-") as cache:
        env = _subprocess_env(Path(cache), path_dir)
        # cwd outside any git checkout: Module.save asks GitPython for the HEAD of the enclosing repo
        # and crashes in one without commits.
        done = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cache, stdin=subprocess.DEVNULL
        )
    if done.returncode != 0:
        raise RuntimeError(
            f"PhysicsNeMo script {cmd[1] if isinstance(script, Path) else '-c'} exited {done.returncode}\n"
            f"--- stdout ---\n{done.stdout[-4000:]}\n--- stderr ---\n{done.stderr[-8000:]}"
        )
    return done.stdout


def _subprocess_env(cache: Path, path_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(
        WARP_CACHE_PATH=str(cache / "warp"),
        LOCAL_CACHE=str(cache / "physicsnemo"),
        PYTHONPATH=str(path_dir),
        PYTHONDONTWRITEBYTECODE="1",
    )
    return env
