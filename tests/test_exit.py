"""A manager that is never closed still commits the saves it started before the interpreter exits."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from checkpointd import load

SRC = Path(__file__).resolve().parent.parent / "src"


def test_started_save_is_committed_at_interpreter_exit(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(SRC)!r})
        from checkpointd import CheckpointManager
        torch.manual_seed(0)
        state = {{"w": torch.randn(2 << 20)}}
        mgr = CheckpointManager({str(tmp_path)!r}, state, compression="zstd")
        mgr.save(7)
        # no wait(), no close(): the script just ends
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "finishing 1 save(s) before exit" in proc.stderr
    torch.manual_seed(0)
    assert torch.equal(load(tmp_path)["w"], torch.randn(2 << 20))
