"""The ``checkpointd`` command line (SPEC §1): in-process ``main(argv)`` and ``python -m``."""

from __future__ import annotations

import io
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from checkpointd.storage import recyclebin
import checkpointd
from checkpointd import CheckpointManager
from checkpointd.cleanup import collect_garbage, parse_duration
from checkpointd.cli import EXIT_CODES, EXIT_UNREACHABLE, Progress, RetryReporter, main, parse_storage_options
from checkpointd.errors import ConfigError
from checkpointd.storage.retry import RetryEvent
from checkpointd.storage.store import Store

SRC = str(Path(__file__).resolve().parent.parent / "src")


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    lin = torch.nn.Linear(6, 3)
    opt = torch.optim.Adam(lin.parameters())
    lin(torch.randn(2, 6)).sum().backward()
    opt.step()
    return {"model": lin, "opt": opt, "extra": {"a": 1}}


@pytest.fixture(scope="module", params=[None, "zstd"], ids=["raw", "zstd"])
def pristine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cli") / "root"
    with CheckpointManager(str(root), _state(), compression=request.param, keep_last=None) as mgr:
        mgr.save(10, metrics={"loss": 0.5})
        mgr.save(20, metrics={"loss": 0.25})
    return root


@pytest.fixture
def root(pristine: Path, tmp_path: Path) -> Path:
    out = tmp_path / "root"
    shutil.copytree(pristine, out)
    return out


def _leftover(root: Path, step: int, age_secs: float) -> Path:
    """An uncommitted copy of step 20 whose files are ``age_secs`` old."""
    d = root / f"step-{step:09d}"
    shutil.copytree(root / "step-000000020", d)
    (d / "COMMITTED").unlink()
    t = time.time() - age_secs
    for p in [*d.iterdir(), d]:
        os.utime(p, (t, t))
    return d


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# -- ls -----------------------------------------------------------------------------------------------
def test_ls(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _leftover(root, 30, 10)
    (root / "step-000000030" / "COMMITTED").write_text("garbage")  # not a valid marker: uncommitted
    with open(root / "step-000000010" / "manifest.json", "a") as f:
        f.write(" ")  # a valid marker, a manifest that no longer matches it: damaged
    code, out, _ = run(capsys, "ls", str(root))
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["STEP", "STATUS", "TIME", "SIZE", "FILES", "CODEC", "METRICS"]
    assert "step 10 is DAMAGED" in out and "does not match" in out
    assert "1 committed, 1 damaged, 1 uncommitted" in out
    row20 = next(line for line in lines if line.split()[:2] == ["20", "committed"])
    assert "loss=0.25" in row20
    assert any(line.split()[:2] == ["30", "uncommitted"] for line in lines)

    code, out, _ = run(capsys, "ls", "--json", str(root))
    rows = {r["step"]: r for r in json.loads(out)["steps"]}
    assert code == 0 and sorted(rows) == [10, 20, 30]
    assert rows[20]["committed"] and rows[20]["files"] == 2 and rows[20]["metrics"] == {"loss": 0.25}
    assert rows[20]["size_bytes"] == sum(p.stat().st_size for p in (root / "step-000000020").iterdir()
                                         if p.name not in ("manifest.json", "COMMITTED"))
    assert rows[30]["status"] == "uncommitted" and rows[10]["status"] == "damaged"


def test_ls_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "ls", str(tmp_path / "missing"))
    assert code == 2 and "nothing at" in err and "no such file or directory" in err


def _one_error_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("checkpointd: error: "), err
    return lines[0]


def test_ls_exit_codes_of_what_is_not_a_checkpoint_root(root: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """Exit 2 with one line on stderr unless a committed step is listed, as ``ls --help`` says."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("hi")
    (tmp_path / "a-file").write_text("hi")
    cases = {"empty": "the directory is empty", "missing": "no such file or directory",
             "other": "no step directories under", "a-file": "is a file, not a checkpoint root"}
    for name, message in cases.items():
        for json_flag in ([], ["--json"]):
            code, out, err = run(capsys, "ls", *json_flag, str(tmp_path / name))
            assert code == 2 and message in _one_error_line(err) and str(tmp_path / name) in err, (name, err)
            assert "Traceback" not in err
    help_text = " ".join(run(capsys, "ls", "--help")[1].split())
    assert "Exit 0 when at least one step is committed; 2 when none is" in help_text

    # only uncommitted and damaged steps: the listing is printed, and the exit code says no checkpoint
    (root / "step-000000020" / "COMMITTED").unlink()
    with open(root / "step-000000010" / "manifest.json", "a") as f:
        f.write(" ")
    code, out, err = run(capsys, "ls", str(root))
    assert code == 2 and "10  DAMAGED" in out and "20  uncommitted" in out
    assert "no committed step under" in _one_error_line(err)
    code, out, err = run(capsys, "ls", "--json", str(root))
    assert code == 2 and [r["status"] for r in json.loads(out)["steps"]] == ["damaged", "uncommitted"]


def test_ls_of_a_real_root_exits_0(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "ls", str(root))
    assert code == 0 and err == "" and "2 committed, 0 damaged, 0 uncommitted" in out


# -- inspect ------------------------------------------------------------------------------------------
def test_inspect(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    step_dir = root / "step-000000020"
    code, out, _ = run(capsys, "inspect", str(step_dir))
    assert code == 0
    assert "step 20  committed" in out and "loss=0.25" in out and f"torch {torch.__version__}" in out
    assert "optimizer_state_dict/state/0/exp_avg" in out and "(3, 6)" in out and "float32" in out

    code, out, _ = run(capsys, "inspect", "--json", str(step_dir))
    doc = json.loads(out)
    assert doc["step"] == 20 and doc["committed"] and doc["entries"]["opt"]["key"] == "optimizer_state_dict"
    linear = next(f for f in doc["files"] if f["path"].startswith("Linear"))
    assert {t["key"]: t["shape"] for t in doc["tensors"][linear["path"]]} == {"weight": [3, 6], "bias": [3]}
    assert linear["checksum"].startswith("crc32:")

    code, out, _ = run(capsys, "inspect", "--json", str(step_dir / linear["path"]))
    assert code == 0 and [t["key"] for t in json.loads(out)["tensors"]] == ["weight", "bias"]


def test_inspect_errors(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "inspect", str(root))
    assert code == 2 and "not a step directory" in err and "checkpointd ls" in err
    (root / "step-000000020" / "COMMITTED").unlink()
    code, out, err = run(capsys, "inspect", str(root / "step-000000020"))
    assert code == 0 and "NOT COMMITTED" in out and "NOT committed" in err
    (root / "step-000000010" / "manifest.json").write_text("{}")
    code, _, err = run(capsys, "inspect", str(root / "step-000000010"))
    assert code == 1 and "does not match" in err


# -- verify (the tampered set lives in test_integrity.py) ---------------------------------------------
def test_verify_ok(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "verify", str(root))
    assert code == 0 and "OK    step 10" in out and "OK    step 20" in out and "all 2 step(s) verify" in out
    code, out, _ = run(capsys, "verify", "--json", "--deep", str(root / "step-000000010"))
    doc = json.loads(out)
    assert code == 0 and doc["ok"] and [s["step"] for s in doc["steps"]] == [10]


def test_verify_fails_naming_every_failing_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Exit 0 only if every committed step verifies: a flipped data byte and a manifest that no longer
    matches its marker both fail, each named; the intact step between them is reported OK."""
    root = tmp_path / "root"
    with CheckpointManager(str(root), _state(), keep_last=None) as mgr:
        for step in (10, 20, 30):
            mgr.save(step)
    data = next(p for p in (root / "step-000000010").iterdir() if p.name.startswith("checkpoint"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    data.write_bytes(bytes(raw))
    with open(root / "step-000000030" / "manifest.json", "a") as f:
        f.write(" ")
    code, out, _ = run(capsys, "verify", str(root))
    assert code == 1
    assert "FAIL  step 10" in out and "OK    step 20" in out and "FAIL  step 30" in out
    assert "2 of 3 step(s) FAILED verification: 10, 30" in out
    code, out, _ = run(capsys, "verify", "--json", str(root))
    doc = json.loads(out)
    assert code == 1 and not doc["ok"] and {s["step"]: s["ok"] for s in doc["steps"]} == {10: False, 20: True, 30: False}
    assert run(capsys, "verify", str(root / "step-000000020"))[0] == 0
    assert run(capsys, "verify", str(root / "step-000000030"))[0] == 1


# -- export -------------------------------------------------------------------------------------------
def test_export(root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    step_dir = root / "step-000000020"
    out_dir = tmp_path / "native"
    code, out, _ = run(capsys, "export", str(step_dir), str(out_dir))
    assert code == 0, out
    assert sorted(p.name for p in out_dir.iterdir()) == ["Linear.0.20.pt", "checkpoint.0.20.pt"]
    saved = checkpointd.load(str(root), step=20)
    model = torch.load(out_dir / "Linear.0.20.pt", weights_only=True)
    assert all(torch.equal(model[k], saved["model"][k]) for k in model)
    training = torch.load(out_dir / "checkpoint.0.20.pt", weights_only=True)
    assert training["epoch"] == 20 and training["metadata"] == {"loss": 0.25}
    # the exported directory is a PhysicsNeMo-style directory that load() also reads
    as_pn = checkpointd.load(str(out_dir))
    assert torch.equal(as_pn["Linear"]["weight"], saved["model"]["weight"])

    code, _, err = run(capsys, "export", str(step_dir), str(out_dir))
    assert code == 2 and "--overwrite" in err
    assert run(capsys, "export", "--overwrite", str(step_dir), str(out_dir))[0] == 0


def test_export_refuses_damage(root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    step_dir = root / "step-000000020"
    f = next(p for p in step_dir.iterdir() if p.name.startswith("checkpoint"))
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    out_dir = tmp_path / "native"
    code, _, err = run(capsys, "export", str(step_dir), str(out_dir))
    assert code == 1 and "checksum" in err
    assert not out_dir.exists() or not list(out_dir.iterdir())  # nothing half-exported is left


# -- gc -----------------------------------------------------------------------------------------------
def test_gc(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old = _leftover(root, 30, 2 * 3600)
    young = _leftover(root, 40, 60)
    committed_old = root / "step-000000010"
    t = time.time() - 10 * 86400
    for p in committed_old.iterdir():
        os.utime(p, (t, t))

    code, out, _ = run(capsys, "gc", "--dry-run", str(root))
    assert code == 0 and "would remove 1" in out and old.exists()

    code, out, _ = run(capsys, "gc", "--json", str(root))
    doc = json.loads(out)
    assert code == 0 and {d["step"]: d["action"] for d in doc["dirs"]} == {30: "removed", 40: "kept (younger than 1h)"}
    assert not old.exists() and young.exists() and committed_old.exists()

    assert run(capsys, "gc", "--older-than", "30s", str(root))[0] == 0
    assert not young.exists()
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".checkpointd")) == [
        "step-000000010", "step-000000020"]  # the library's own bookkeeping (its lease) aside
    assert checkpointd.load(str(root), step=10)["extra"] == {"a": 1}


def test_gc_empties_the_recycling_bin(root: Path, capsys: pytest.CaptureFixture[str]) -> None:

    bin_dir = root / recyclebin.BIN_NAME  # what a crashed run leaves: retired files no save took
    bin_dir.mkdir()
    for name in ("a.bin", "b.checking"):
        with open(bin_dir / name, "wb") as f:
            f.truncate(recyclebin.MIN_RECYCLE_BYTES)
    code, out, _ = run(capsys, "gc", "--dry-run", str(root))
    assert code == 0 and "would remove 2 retired file(s)" in out and (bin_dir / "a.bin").exists()
    code, out, _ = run(capsys, "gc", "--json", str(root))
    assert code == 0 and json.loads(out)["recycle_bin"] == {"files": 2, "bytes": 2 * recyclebin.MIN_RECYCLE_BYTES}
    assert not bin_dir.exists()
    assert json.loads(run(capsys, "gc", "--json", str(root))[1])["recycle_bin"] == {"files": 0, "bytes": 0}


def test_gc_memory_url(capsys: pytest.CaptureFixture[str]) -> None:
    url = "memory://cli-gc/root"
    with CheckpointManager(url, _state()) as mgr:
        mgr.save(1)
    store = Store(url)
    store.write_bytes("step-000000002/Linear.0.2.pt", b"partial")
    assert [r.action for r in collect_garbage(store)] == ["kept (younger than 1h)"]
    code, out, _ = run(capsys, "gc", "--older-than", "0", url)
    assert code == 0 and "removed 1" in out
    assert store.list_dir("") == ["step-000000001"]
    assert run(capsys, "verify", url)[0] == 0
    assert run(capsys, "ls", "-o", "skip_instance_cache=true", url)[0] == 0


@pytest.mark.parametrize("text,secs", [("3600", 3600), ("90s", 90), ("30m", 1800), ("1h", 3600), ("2d", 172800), ("0", 0)])
def test_parse_duration(text: str, secs: float) -> None:
    assert parse_duration(text) == secs


def test_usage_errors(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "gc", "--older-than", "soon", str(root))[0] == 2
    assert run(capsys)[0] == 2
    assert run(capsys, "frobnicate")[0] == 2
    assert run(capsys, "export", str(root / "step-000000020"))[0] == 2
    code, _, err = run(capsys, "ls", "-o", "novalue", str(root))
    assert code == 2 and "KEY=VALUE" in err


def test_an_option_the_backend_refuses_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "ls", "-o", f"endpoint_url=http://127.0.0.1:{_closed_port()}", "-o", "key=k",
                       "-o", "secret=s", "-o", "no_such_option=1", "--retry-timeout", "0", "s3://bucket/x")
    assert code == 2 and "no_such_option" in _one_error_line(err) and "--storage-option" in err


def test_output_piped_into_a_closed_reader_ends_quietly(root: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """``checkpointd ls ROOT | head -1``: the reader goes away; no error line, no traceback, exit 141."""
    class ClosedPipe(io.StringIO):
        def write(self, text: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    assert main(["ls", str(root)]) == 141
    assert capsys.readouterr().err == ""


def test_storage_options() -> None:
    assert parse_storage_options(["anon=true", "n=3", "url=http://x:9000", 'h={"a": 1}']) == {
        "anon": True, "n": 3, "url": "http://x:9000", "h": {"a": 1}}
    with pytest.raises(ConfigError):
        parse_storage_options(["=1"])


def test_progress_only_on_tty() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty, pipe = Tty(), io.StringIO()
    for stream in (tty, pipe):
        with Progress(100, "verify", stream=stream) as bar:
            bar.update(40)
            bar.update(60)
    assert "100%" in tty.getvalue() and "[#" in tty.getvalue()
    assert pipe.getvalue() == ""


# -- as a program -------------------------------------------------------------------------------------
def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "checkpointd", *argv], capture_output=True, text=True, env=env, timeout=120)


def test_python_m(tmp_path: Path) -> None:
    """The program itself: help with exit codes, JSON output, and exit code 1 naming the failing step."""
    root = tmp_path / "root"
    with CheckpointManager(str(root), _state(), keep_last=None) as mgr:
        mgr.save(10)
        mgr.save(20)
    help_ = _cli("--help")
    assert help_.returncode == 0
    for code in EXIT_CODES:
        assert f"  {code} " in help_.stdout
    for command in ("ls", "inspect", "verify", "export", "gc"):
        assert command in help_.stdout

    listing = _cli("ls", "--json", str(root))
    assert listing.returncode == 0 and [r["step"] for r in json.loads(listing.stdout)["steps"]] == [10, 20]

    (root / "step-000000020" / "manifest.json").write_text("{}")
    bad = _cli("verify", str(root))
    assert bad.returncode == 1 and "FAILED verification: 20" in bad.stdout and "OK    step 10" in bad.stdout


# -- storage that cannot be reached -------------------------------------------------------------------
def _closed_port() -> int:
    """A localhost port nothing listens on: bound, read, closed."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _unreachable(*argv: str, retry_timeout: str = "3") -> list[str]:
    return [*argv, "s3://bucket/x", "-o", f"endpoint_url=http://127.0.0.1:{_closed_port()}", "-o", "key=k",
            "-o", "secret=s", "--retry-timeout", retry_timeout]


def test_unreachable_endpoint_reports_retries_and_ends_with_one_line() -> None:
    started = time.monotonic()
    proc = _cli(*_unreachable("ls"))
    took = time.monotonic() - started
    assert proc.returncode == EXIT_UNREACHABLE == 3, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert all(line.startswith("checkpointd: ") for line in lines), proc.stderr
    progress = [line for line in lines if "retrying for another" in line]
    assert progress and all(line.startswith("checkpointd: cannot reach s3://bucket/x: ") for line in progress)
    errors = [line for line in lines if line.startswith("checkpointd: error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0]
    assert errors[0].startswith("checkpointd: error: cannot reach s3://bucket/x after ")
    assert "s of retries" in errors[0] and "Could not connect" in errors[0] and "Check the endpoint" in errors[0]
    assert took < 30, f"took {took:.1f} s with --retry-timeout 3"  # not the default two minutes


def test_a_reachable_s3_root(s3_root: str, s3_storage_options: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    """The same commands on a live S3 server: no retry lines, exit codes as on local disk."""
    with CheckpointManager(s3_root, _state(), storage_options=s3_storage_options, keep_last=None) as mgr:
        mgr.save(10)
    opts = [arg for k, v in s3_storage_options.items() for arg in ("-o", f"{k}={json.dumps(v)}")]
    code, out, err = run(capsys, "ls", *opts, "--retry-timeout", "5", s3_root)
    assert code == 0 and err == "" and "1 committed" in out
    code, out, err = run(capsys, "verify", *opts, s3_root)
    assert code == 0 and err == "" and "OK    step 10" in out
    code, _, err = run(capsys, "ls", *opts, s3_root.rstrip("/") + "-nothing-here")
    assert code == 2 and "no such file or directory" in _one_error_line(err)


@pytest.mark.parametrize("argv", [("inspect",), ("verify",), ("export", "OUT"), ("gc",)], ids=lambda a: a[0])
def test_every_storage_command_takes_retry_timeout(argv: tuple[str, ...], tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    args = [a if a != "OUT" else str(tmp_path / "out") for a in argv]
    command, rest = args[0], args[1:]
    started = time.monotonic()
    code, out, err = run(capsys, *_unreachable(command, retry_timeout="2"), *rest)
    assert code == EXIT_UNREACHABLE and out == "" and "Traceback" not in err
    assert "retrying for another" in err
    assert err.splitlines()[-1].startswith("checkpointd: error: cannot reach s3://bucket/x after ")
    assert time.monotonic() - started < 20
    assert "--retry-timeout SECS" in run(capsys, command, "--help")[1]


def _event(attempt: int, elapsed: float, giving_up: bool = False, error: BaseException | None = None) -> RetryEvent:
    return RetryEvent(describe="list s3://b/r", attempt=attempt, error=error or ConnectionRefusedError("refused"),
                      elapsed_secs=elapsed, delay_secs=0.0 if giving_up else 0.5, budget_secs=120.0,
                      giving_up=giving_up)


def test_retry_reporter_throttles_and_remembers_who_gave_up() -> None:
    now = [0.0]
    stream = io.StringIO()
    reporter = RetryReporter(stream=stream, interval_secs=5.0, clock=lambda: now[0])
    hook = reporter.hook("s3://b/r")
    for attempt, t in enumerate([0.0, 1.0, 4.9, 5.0, 7.0, 10.5], start=1):
        now[0] = t
        hook(_event(attempt, elapsed=t + 8))
    lines = stream.getvalue().splitlines()
    assert lines == [
        "checkpointd: cannot reach s3://b/r: ConnectionRefusedError: refused; retrying for another 112 s (attempt 2)",
        "checkpointd: cannot reach s3://b/r: ConnectionRefusedError: refused; retrying for another 107 s (attempt 5)",
        "checkpointd: cannot reach s3://b/r: ConnectionRefusedError: refused; retrying for another 102 s (attempt 7)",
    ]
    error = TimeoutError("read timed out")
    assert reporter.gave_up_on(error) is None
    hook(_event(9, elapsed=118.0, giving_up=True, error=error))
    assert stream.getvalue().splitlines() == lines  # giving up prints nothing: the caller ends the command
    wrapped = RuntimeError("save failed")
    wrapped.__cause__ = error
    assert reporter.gave_up_on(wrapped) == ("s3://b/r", _event(9, elapsed=118.0, giving_up=True, error=error))
    assert reporter.gave_up_on(TimeoutError("another")) is None
