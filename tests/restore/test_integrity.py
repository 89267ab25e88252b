"""Integrity: a tampered-checkpoint set against verify and restore, and partial reads."""

from __future__ import annotations

import io
import json
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from checkpointd import CheckpointManager, CorruptCheckpointError
from checkpointd.cli import main
from checkpointd.format.manifest import FORMAT_VERSION
from checkpointd.restore.checkpoint_file import CheckpointFile
from checkpointd.restore.partial import load_tensor, load_tensors
from checkpointd.storage.store import Store
from checkpointd.testing.tamper import rewrite_manifest
from checkpointd.restore.verify import verify_step
from fake_physicsnemo import FakePNModule

STEPS = (10, 20)


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 4)
    opt = torch.optim.Adam(lin.parameters())
    lin(torch.randn(2, 8)).sum().backward()
    opt.step()
    return {"model": lin, "opt": opt, "extra": {"a": 1}}


@pytest.fixture(scope="module", params=[None, "zstd"], ids=["raw", "zstd"])
def pristine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pristine") / "root"
    with CheckpointManager(str(root), _state(), compression=request.param, keep_last=None) as mgr:
        for s in STEPS:
            mgr.save(s, metrics={"loss": 1.0 / s})
    return root


@pytest.fixture
def root(pristine: Path, tmp_path: Path) -> Path:
    out = tmp_path / "root"
    shutil.copytree(pristine, out)
    return out


def _data_file(step_dir: Path) -> Path:
    return next(p for p in sorted(step_dir.iterdir()) if p.name.startswith("checkpoint."))


def _truncate(d: Path) -> None:
    f = _data_file(d)
    f.write_bytes(f.read_bytes()[:-7])


def _flip(d: Path) -> None:
    f = _data_file(d)
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x40
    f.write_bytes(bytes(data))


def _future(doc: dict[str, Any]) -> None:
    doc["format_version"] = FORMAT_VERSION + 1


TAMPERS: dict[str, tuple[Callable[[Path], None], int, str]] = {
    # name: (tamper the newest step, exit code of `verify STEP_DIR`, message)
    "truncated file": (_truncate, 1, "truncated or altered"),
    "flipped byte": (_flip, 1, "fails its checksum"),
    "missing file": (lambda d: _data_file(d).unlink(), 1, "listed in the manifest but missing"),
    "extra file": (lambda d: (d / "notes.txt").write_text("hi"), 0, "not listed in the manifest"),
    "manifest edited after commit": (
        lambda d: rewrite_manifest(d, lambda doc: doc["metrics"].update(loss=0.0), commit=False), 1,
        "does not match the checksum in COMMITTED"),
    "manifest missing": (lambda d: (d / "manifest.json").unlink(), 1, "has no manifest.json"),
    "marker missing": (lambda d: (d / "COMMITTED").unlink(), 1, "no COMMITTED marker"),
    "marker garbage": (lambda d: (d / "COMMITTED").write_bytes(b"\x00garbage{"), 1, "not a valid commit marker"),
    "manifest garbage, recommitted": (lambda d: _garbage_manifest(d), 1, "not valid JSON"),
    "format_version from the future": (lambda d: rewrite_manifest(d, _future), 1, "upgrade checkpointd"),
}


def _garbage_manifest(d: Path) -> None:
    from checkpointd.testing.tamper import recommit

    (d / "manifest.json").write_bytes(b"{not json")
    try:
        recommit(d)
    except ValueError:  # recommit reads the step from the manifest
        marker = {"manifest": "manifest.json", "manifest_checksum": _sha(d / "manifest.json"), "step": 20}
        (d / "COMMITTED").write_text(json.dumps(marker))


def _sha(p: Path) -> str:
    from checkpointd.codecs.checksum import sha256_hex

    return sha256_hex(p.read_bytes())


@pytest.mark.parametrize("name", list(TAMPERS))
def test_tampered_set(root: Path, name: str, capsys: pytest.CaptureFixture[str]) -> None:
    tamper, code, message = TAMPERS[name]
    newest = root / "step-000000020"
    tamper(newest)

    assert main(["verify", str(newest)]) == code
    out, err = capsys.readouterr()
    assert message in out + err
    if code:
        assert "FAIL" in out and "step 20" in out

    # the whole root: the damaged newest step fails and is named; a step that lost its marker (or whose
    # marker is not a valid one) is not a checkpoint, so only the intact one is checked
    root_code = 0 if name in ("extra file", "marker missing", "marker garbage") else 1
    assert main(["verify", str(root)]) == root_code
    out = capsys.readouterr().out
    assert "OK    step 10" in out
    if root_code:
        assert "FAILED verification: 20" in out

    # restore never takes the damaged step; it falls back to the older one with a warning
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        restored = CheckpointManager(str(root), _state()).restore_latest()
    assert restored == (20 if name == "extra file" else 10)


def test_verify_names_every_failing_step(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for s in STEPS:
        _flip(root / f"step-{s:09d}")
    assert main(["verify", "--json", str(root)]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert [s["step"] for s in doc["steps"] if not s["ok"]] == [10, 20]
    with pytest.raises(CorruptCheckpointError, match="none verifies"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            CheckpointManager(str(root), _state()).restore_latest()


def test_verify_nothing_found(tmp_path: Path, root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(tmp_path / "nope")]) == 2
    for s in STEPS:
        (root / f"step-{s:09d}" / "COMMITTED").unlink()
    assert main(["verify", str(root)]) == 2
    assert "no committed step" in capsys.readouterr().err


def test_verify_step_report_and_deep(root: Path) -> None:
    store = Store(str(root))
    report = verify_step(store, "step-000000020", deep=True)
    assert report.ok and report.step == 20 and report.files == 2 and report.nbytes > 0


# -- partial reads ------------------------------------------------------------------------------------
class CountingReader(io.RawIOBase):
    """Counts the bytes read through it."""

    def __init__(self, f: Any) -> None:
        super().__init__()
        self.f, self.nbytes = f, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.f.seek(offset, whence)

    def tell(self) -> int:
        return self.f.tell()

    def readinto(self, buffer: Any) -> int:
        data = self.f.read(memoryview(buffer).nbytes)
        self.nbytes += len(data)
        memoryview(buffer).cast("B")[: len(data)] = data
        return len(data)

    def close(self) -> None:
        self.f.close()
        super().close()


@pytest.fixture(scope="module", params=[None, "zstd"], ids=["raw", "zstd"])
def big(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor], str]:
    """A 50 MB checkpoint: 25 random 2 MB tensors in one file."""
    root = tmp_path_factory.mktemp("big") / "root"
    gen = torch.Generator().manual_seed(1)
    tensors = {f"t{i}": torch.rand(512 * 1024, generator=gen) for i in range(25)}
    with CheckpointManager(str(root), {"big": tensors}, compression=request.param) as mgr:
        mgr.save(1)
    return root, tensors, "zstd" if request.param else "none"


def test_partial_read_reads_little(big: tuple[Path, dict[str, torch.Tensor], str]) -> None:
    root, tensors, codec = big
    step_dir = root / "step-000000001"
    path = _data_file(step_dir)
    assert path.stat().st_size > 50e6 if codec == "none" else path.stat().st_size > 40e6
    counting = CountingReader(open(path, "rb"))
    with CheckpointFile(counting, codec=codec, fmt="pt", where=str(path)) as f:
        t = f.load_tensor("big/t17")
        assert torch.equal(t, tensors["t17"])
        assert [i.key for i in f.tensors()][:2] == ["big/t0", "big/t1"]
    print(f"partial read of 2 MB from {path.stat().st_size} bytes ({codec}): {counting.nbytes} bytes read")
    assert counting.nbytes < 5e6, counting.nbytes


def test_partial_read_api(big: tuple[Path, dict[str, torch.Tensor], str]) -> None:
    root, tensors, _ = big
    assert torch.equal(load_tensor(str(root), "big/t3"), tensors["t3"])
    assert torch.equal(load_tensor(str(root / "step-000000001"), ["big", "t4"], step=None), tensors["t4"])
    got = load_tensors(str(root), ["big/t0", "big/t24"], step=1)
    assert torch.equal(got["big/t24"], tensors["t24"])
    assert torch.equal(load_tensor(str(_data_file(root / "step-000000001")), "big/t5"), tensors["t5"])
    with pytest.raises(FileNotFoundError, match="no key 't99'"):
        load_tensor(str(root), "big/t99")
    with pytest.raises(FileNotFoundError, match="no state entry 'nope'"):
        load_tensor(str(root), "nope/x")


def test_partial_read_detects_damage(root: Path) -> None:
    """A flipped byte inside the record read is caught by its own checksum (zip CRC or codec chunk)."""
    step_dir = root / "step-000000020"
    f = step_dir / next(p.name for p in step_dir.iterdir() if p.name.startswith("Linear"))
    with CheckpointFile(open(f, "rb"), codec="zstd" if f.name.endswith(".zst") else "none") as cf:
        weight = cf.load_tensor("weight")
    data = bytearray(f.read_bytes())
    native = cf.tensors()
    assert native[0].key == "weight"
    if not f.name.endswith(".zst"):
        pos = bytes(data).find(weight.numpy().tobytes())
        data[pos + 3] ^= 1
    else:
        data[len(data) // 3] ^= 1
    f.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError):
        load_tensors(str(step_dir), ["model/weight", "model/bias"])


class FakePN(FakePNModule):
    """Duck-typed PhysicsNeMo module, so its file is a .mdlus."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_partial_read_of_mdlus_on_memory_url(compression: str | None) -> None:
    """Partial reads work on any fsspec URL (here memory://) and through a .mdlus window."""
    root = f"memory://partial-{compression}/root"
    net = FakePN()
    with CheckpointManager(root, {"net": net}, compression=compression) as mgr:
        mgr.save(3)
    assert torch.equal(load_tensor(root, "net/lin.weight"), net.lin.weight.detach())
    assert torch.equal(load_tensor(root, "net/lin.bias", step=3), net.lin.bias.detach())
