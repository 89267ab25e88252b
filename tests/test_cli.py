"""The ``checkpointd`` command line (SPEC §1, issue 4 part 6): in-process ``main(argv)`` and ``python -m``."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import checkpointd
from checkpointd import CheckpointManager
from checkpointd.cleanup import collect_garbage, parse_duration
from checkpointd.cli import EXIT_CODES, Progress, main, parse_storage_options
from checkpointd.errors import ConfigError
from checkpointd.storage import Store

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
    (root / "step-000000010" / "COMMITTED").write_text("garbage")
    code, out, _ = run(capsys, "ls", str(root))
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["STEP", "STATUS", "TIME", "SIZE", "FILES", "CODEC", "METRICS"]
    assert "DAMAGED" in out and "malformed" in out
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
    assert code == 2 and "nothing at" in err


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
    assert sorted(p.name for p in root.iterdir()) == ["step-000000010", "step-000000020"]
    assert checkpointd.load(str(root), step=10)["extra"] == {"a": 1}


def test_gc_empties_the_recycling_bin(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from checkpointd import recycle

    bin_dir = root / recycle.BIN_NAME  # what a crashed run leaves: retired files no save took
    bin_dir.mkdir()
    for name in ("a.bin", "b.checking"):
        with open(bin_dir / name, "wb") as f:
            f.truncate(recycle.MIN_RECYCLE_BYTES)
    code, out, _ = run(capsys, "gc", "--dry-run", str(root))
    assert code == 0 and "would remove 2 retired file(s)" in out and (bin_dir / "a.bin").exists()
    code, out, _ = run(capsys, "gc", "--json", str(root))
    assert code == 0 and json.loads(out)["recycle_bin"] == {"files": 2, "bytes": 2 * recycle.MIN_RECYCLE_BYTES}
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
