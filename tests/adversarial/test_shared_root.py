"""One writer per root: a second process that would save into a root held by a live writer raises
``RootInUseError`` naming the holder; readers need no lease; a SIGKILLed holder is taken over at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import checkpointd
from checkpointd import CheckpointManager

from . import craft

_SRC = str(Path(checkpointd.__file__).resolve().parent.parent)
_TESTS = str(Path(__file__).resolve().parent.parent)

_CHILD = """
import json, sys, time
sys.path[:0] = [{src!r}, {tests!r}]
import checkpointd
from adversarial import craft
root, action, arg = sys.argv[1], sys.argv[2], sys.argv[3]
out = {{"pid": __import__("os").getpid()}}
try:
    if action == "save":
        with checkpointd.CheckpointManager(root, craft.new_state(), compression=None, keep_last=None) as mgr:
            for step in json.loads(arg):
                mgr.save(step)
                mgr.wait()
            time.sleep(4)  # still the writer while the other process starts saving: the two overlap
            out["saved"] = True
    elif action == "hold":
        mgr = checkpointd.CheckpointManager(root, craft.new_state(), compression=None, keep_last=None)
        mgr.save(int(arg)); mgr.wait()
        print("HELD", flush=True)
        time.sleep(120)
    elif action == "read":
        state = craft.new_state(seed=4)
        with checkpointd.CheckpointManager(root, state, compression=None) as mgr:
            out["restored"] = mgr.restore_latest()
        out["load"] = sorted(checkpointd.load(root))
        out["verify"] = craft.cli("verify", root)[0]
        out["ls"] = craft.cli("ls", root)[0]
except checkpointd.CheckpointError as exc:
    out["error"], out["message"] = type(exc).__name__, str(exc)
print("RESULT " + json.dumps(out), flush=True)
"""


def _child(root: Path, action: str, arg: str = "0") -> subprocess.Popen[str]:
    code = _CHILD.format(src=_SRC, tests=_TESTS)
    return subprocess.Popen([sys.executable, "-c", code, str(root), action, arg], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _result(proc: subprocess.Popen[str]) -> dict:
    out, err = proc.communicate(timeout=120)
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert lines, f"child failed: {err[-2000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def test_second_writer_process_is_refused_and_readers_work(root: Path) -> None:
    state = craft.new_state()
    with CheckpointManager(str(root), state, compression=None, keep_last=None) as mgr:
        mgr.save(1)
        mgr.wait()
        got = _result(_child(root, "save", "[2]"))
        assert got.get("error") == "RootInUseError", got
        assert str(os.getpid()) in got["message"], f"the error does not name the holder: {got['message']}"
        got = _result(_child(root, "read"))
        assert "error" not in got, got
        assert got["restored"] == 1 and got["verify"] == 0 and got["ls"] == 0
        mgr.save(3)  # readers did not take the lease
        mgr.wait()
        assert mgr.steps() == [1, 3]


def test_second_writer_in_the_same_process_is_refused(root: Path) -> None:
    with CheckpointManager(str(root), craft.new_state(), compression=None) as first:
        first.save(1)
        first.wait()
        with CheckpointManager(str(root), craft.new_state(), compression=None) as second:
            with pytest.raises(checkpointd.RootInUseError):
                second.save(2)
                second.wait()
        assert first.steps() == [1]


def test_sigkilled_holder_is_taken_over_at_once(root: Path) -> None:
    holder = _child(root, "hold", "1")
    try:
        line = holder.stdout.readline()  # type: ignore[union-attr]
        assert line.strip() == "HELD", holder.stderr.read() if holder.poll() is not None else line  # type: ignore[union-attr]
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.communicate(timeout=60)
    t0 = time.monotonic()
    with CheckpointManager(str(root), craft.new_state(), compression=None, keep_last=None) as mgr:
        assert mgr.resume() == 2
        mgr.save(2)
        mgr.wait()
        assert mgr.steps() == [1, 2]
    assert time.monotonic() - t0 < 10, "the restarted job waited for the dead holder's lease"


def test_concurrent_writers_at_most_one_writes(root: Path) -> None:
    ranges = {"a": list(range(100, 106)), "b": list(range(200, 206))}
    procs = {k: _child(root, "save", json.dumps(v)) for k, v in ranges.items()}
    results = {k: _result(p) for k, p in procs.items()}
    writers = [k for k, r in results.items() if r.get("saved")]
    refused = [k for k, r in results.items() if r.get("error") == "RootInUseError"]
    assert len(writers) <= 1 and len(writers) + len(refused) == 2, results
    with CheckpointManager(str(root), craft.new_state(), compression=None) as mgr:
        steps = mgr.steps()
    assert all(s in ranges[writers[0]] for s in steps) if writers else True, steps
    assert set(steps) <= set(ranges["a"]) or set(steps) <= set(ranges["b"]), f"both processes committed steps: {steps}"
    if steps:
        code, out = craft.cli("verify", root)
        assert code == 0, out
