"""Preemption (``save_on_signals``): SIGTERM/SIGUSR1 make the next ``maybe_save`` save whatever the
schedule says, ``close(timeout)`` flushes it, earlier handlers are chained and put back on close."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from checkpointd import CheckpointManager, ConfigError

_SRC = str(Path(__file__).resolve().parent.parent / "src")

_WORKER = textwrap.dedent("""
    import signal, sys, time
    sys.path.insert(0, {src!r})
    import torch
    from checkpointd import CheckpointManager

    root, sig = sys.argv[1], sys.argv[2]
    def previous(signum, frame):
        print("previous handler called", flush=True)
    signal.signal(getattr(signal, sig), previous)   # the job's own handler, installed first
    state = {{"t": torch.zeros(8), "meta": {{"step": -1}}}}
    mgr = CheckpointManager(root, state, every_n_steps=10**6, keep_last=None, save_on_signals=True)
    print("ready", flush=True)
    step = 1
    while True:
        state["t"].fill_(float(step))
        state["meta"]["step"] = step
        if mgr.maybe_save(step):
            print(f"saved {{step}}", flush=True)
        if mgr.preempted:
            mgr.close(timeout=60)
            print("closed", flush=True)
            sys.exit(0)
        print(f"step {{step}}", flush=True)
        time.sleep(0.005)
        step += 1
""")


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGUSR1"])
def test_signal_mid_loop_ends_with_a_committed_checkpoint(tmp_path, sig):
    script = tmp_path / "worker.py"
    script.write_text(_WORKER.format(src=_SRC))
    root = tmp_path / "ckpt"
    proc = subprocess.Popen([sys.executable, str(script), str(root), sig], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        last_before = 0
        while last_before < 20:  # let it train a little
            line = proc.stdout.readline()
            if line.startswith("step "):
                last_before = int(line.split()[1])
        proc.send_signal(getattr(signal, sig))
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    lines = out.splitlines()
    saved = [int(line.split()[1]) for line in lines if line.startswith("saved ")]
    assert len(saved) == 1, out
    assert "previous handler called" in lines and lines[-1] == "closed"
    assert saved[0] > last_before  # the step after the signal, not an earlier one
    live = {"t": torch.full((8,), -1.0), "meta": {}}
    with CheckpointManager(root, live) as mgr:
        assert mgr.steps() == saved
        assert mgr.restore_latest() == saved[0]
    assert live["meta"] == {"step": saved[0]} and torch.equal(live["t"], torch.full((8,), float(saved[0])))


def test_flag_forces_exactly_one_save_and_handlers_are_restored(tmp_path):
    before = signal.getsignal(signal.SIGUSR1)
    state = {"t": torch.zeros(4)}
    mgr = CheckpointManager(tmp_path / "ckpt", state, every_n_steps=100, save_on_signals=[signal.SIGUSR1])
    assert signal.getsignal(signal.SIGUSR1) != before
    assert mgr.maybe_save(1) is False and not mgr.preempted
    os.kill(os.getpid(), signal.SIGUSR1)
    time.sleep(0.05)  # the handler runs between bytecodes of the main thread
    assert mgr.preempted
    assert mgr.maybe_save(2) is True  # not due, saved because of the signal
    assert mgr.maybe_save(3) is False  # one signal, one save
    assert mgr.preempted  # stays set: the loop should end
    mgr.close(timeout=30)
    assert signal.getsignal(signal.SIGUSR1) == before
    with CheckpointManager(tmp_path / "ckpt", {"t": torch.zeros(4)}) as check:
        assert check.steps() == [2]


def test_signal_on_an_already_committed_step_does_not_raise(tmp_path):
    state = {"t": torch.zeros(4)}
    with CheckpointManager(tmp_path / "ckpt", state, every_n_steps=5, save_on_signals=True) as mgr:
        assert mgr.maybe_save(5) is True
        mgr.wait()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert mgr.maybe_save(5) is False  # e.g. the loop re-runs the step; nothing to add
        assert mgr.preempted
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_default_installs_no_handler(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    with CheckpointManager(tmp_path / "ckpt", {"t": torch.zeros(1)}) as mgr:
        assert signal.getsignal(signal.SIGTERM) == before
        assert mgr.preempted is False


def test_off_the_main_thread_is_a_clear_config_error(tmp_path):
    errors: list[BaseException] = []

    def build() -> None:
        try:
            CheckpointManager(tmp_path / "ckpt", {"t": torch.zeros(1)}, save_on_signals=True)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    t = threading.Thread(target=build)
    t.start()
    t.join()
    assert len(errors) == 1 and isinstance(errors[0], ConfigError)
    assert "main thread" in str(errors[0])


@pytest.mark.parametrize("bad", [[signal.SIGKILL], ["nope"]])
def test_uncatchable_or_bad_signals_are_config_errors(tmp_path, bad):
    with pytest.raises(ConfigError, match="signal"):
        CheckpointManager(tmp_path / "ckpt", {"t": torch.zeros(1)}, save_on_signals=bad)
