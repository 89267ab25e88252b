"""Links planted in a shared checkpoint root: nothing outside the root is ever deleted, truncated or
written, whatever links the root holds (SPEC §2, untrusted input).

Each attack plants symbolic or hard links into ``root`` that lead to ``outside`` (or to another run),
runs saves, retention, ``close()`` or ``checkpointd gc``, and asserts that everything outside keeps its
content (and its link counts, once the library has removed the names planted in the root), and that the
run itself is unharmed: saves commit and restore bit-exact.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from checkpointd import CheckpointManager, CheckpointWriteError, load
from checkpointd.storage import filesahead, recyclebin
from checkpointd.errors import LinkedPathError
from checkpointd.storage.store import Store

from . import craft
from .conftest import fingerprint

BIN = recyclebin.BIN_NAME
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def small_recycling(monkeypatch: pytest.MonkeyPatch) -> None:
    """Files of 32 KiB and more are recycled (instead of 16 MiB), so small models exercise the bin."""
    monkeypatch.setattr(recyclebin, "MIN_RECYCLE_BYTES", 32 << 10)


def _entries(root) -> list[str]:
    """The root's entries, less the lease's lock file (kept for good: removing a lock others may wait on races)."""
    return sorted(n for n in os.listdir(root) if n != ".checkpointd-lease.lock")


def _model(seed: float) -> torch.nn.Module:
    model = torch.nn.Linear(128, 128, bias=False)  # 64 KiB of weights: recycled under the fixture above
    with torch.no_grad():
        model.weight.copy_(torch.arange(128 * 128, dtype=torch.float32).reshape(128, 128) * seed)
    return model


def _save(root: Path, steps: list[int], **kwargs) -> torch.nn.Module:
    model = _model(1.0)
    with CheckpointManager(root, {"model": model}, every_n_steps=1, **kwargs) as mgr:
        for step in steps:
            with torch.no_grad():
                model.weight.add_(1.0)
            mgr.save(step)
            mgr.wait()
    return model


def _restores(root: Path, step: int, model: torch.nn.Module) -> None:
    fresh = _model(0.0)
    with CheckpointManager(root, {"model": fresh}) as mgr:
        assert mgr.restore_latest() == step
    assert torch.equal(fresh.weight, model.weight)


def _gc(root: Path) -> tuple[int, str]:
    """``checkpointd gc ROOT --older-than 0`` (in this process): the exit code and the output."""
    return craft.cli("gc", str(root), "--older-than", "0")


def _other_run(tmp_path: Path) -> tuple[Path, dict]:
    """Another run's root with committed step 10, and its fingerprint."""
    other = tmp_path / "other-run"
    _save(other, [10])
    assert (other / "step-000000010" / "COMMITTED").is_file()
    return other, fingerprint(other)


# -- the recycling bin ------------------------------------------------------------------------------


@pytest.mark.skipif(recyclebin.F_SETLEASE is None, reason="recycling needs Linux leases")
def test_a_bin_linked_outside_is_never_used_and_removed_as_a_link(root, outside, caplog) -> None:
    """``<root>/.checkpointd-recycle -> outside``: retention, files made ahead and ``close()`` never
    move, write or unlink anything there (``precious.bin`` looks like a bin entry); recycling is
    skipped with one warning naming the link, and ``close()`` removes the link itself."""
    top, check = outside
    root.mkdir()
    (root / BIN).symlink_to(top, target_is_directory=True)
    with caplog.at_level(logging.WARNING, logger="checkpointd"):
        model = _save(root, [1, 2, 3, 4], keep_last=1)
    check()
    assert not os.path.lexists(root / BIN)  # close() removed the link, not its target
    assert _entries(root) == ["step-000000004"]
    warnings = [r.getMessage() for r in caplog.records if BIN in r.getMessage()]
    assert len(warnings) == 1 and "symbolic link" in warnings[0] and "Remove it" in warnings[0]
    _restores(root, 4, model)


@pytest.mark.skipif(recyclebin.F_SETLEASE is None, reason="recycling needs Linux leases")
def test_gc_removes_a_bin_linked_outside_as_a_link(root, outside) -> None:
    top, check = outside
    model = _save(root, [1])
    (root / BIN).symlink_to(top, target_is_directory=True)
    code, out = _gc(root)
    assert code == 0, out
    check()
    assert not os.path.lexists(root / BIN)
    _restores(root, 1, model)


@pytest.mark.skipif(recyclebin.F_SETLEASE is None, reason="recycling needs Linux leases")
def test_a_hard_link_planted_in_the_bin_is_never_written(root, outside, monkeypatch) -> None:
    """A hard link to someone else's file, named and sized like a retired file, is never taken by a
    save: the outside file keeps its bytes, and the planted name is gone after ``close()``."""
    top, check = outside
    monkeypatch.setattr(filesahead, "FILES_AHEAD_SETS", 0)  # no blank files: the bin holds only the planted one
    model = _model(1.0)
    with CheckpointManager(root, {"model": model}, every_n_steps=1, keep_last=1) as mgr:
        mgr.save(1)
        mgr.wait()
        (root / BIN).mkdir(exist_ok=True)
        planted = root / BIN / ("0" * 32 + ".bin")
        os.link(top / "precious.bin", planted)  # 64 KiB: within what the model's file would take
        assert planted.stat().st_size >= recyclebin.MIN_RECYCLE_BYTES
        for step in (2, 3, 4):
            with torch.no_grad():
                model.weight.add_(1.0)
            mgr.save(step)
            mgr.wait()
            assert torch.equal(load(root, step=step)["model"]["weight"], model.weight)
    check()  # the planted name is gone (retirement or close), never written through
    _restores(root, 4, model)


# -- step directories that are links --------------------------------------------------------------


def test_a_save_into_a_step_linked_to_another_run_removes_only_the_link(root, tmp_path) -> None:
    """``<root>/step-000000010 -> <other run>/step-000000010``: saving step 10 never touches the other
    run's committed step (its marker above all); the link is replaced by this run's own step."""
    other, before = _other_run(tmp_path)
    root.mkdir()
    (root / "step-000000010").symlink_to(other / "step-000000010", target_is_directory=True)
    model = _save(root, [10])
    assert fingerprint(other) == before
    assert not (root / "step-000000010").is_symlink() and (root / "step-000000010" / "COMMITTED").is_file()
    _restores(root, 10, model)


def test_a_save_into_a_linked_step_never_writes_through_the_link(root, tmp_path) -> None:
    """Whatever happens to the save itself, the other run's step is untouched and this run's error (if
    any) is the library's own."""
    other, before = _other_run(tmp_path)
    root.mkdir()
    (root / "step-000000010").symlink_to(other / "step-000000010", target_is_directory=True)
    model = _model(1.0)
    with CheckpointManager(root, {"model": model}, every_n_steps=1) as mgr:
        mgr.save(10)
        try:
            mgr.wait()
        except CheckpointWriteError:
            pass
    assert fingerprint(other) == before


def test_retention_and_gc_remove_a_linked_step_as_a_link(root, tmp_path) -> None:
    other, before = _other_run(tmp_path)
    root.mkdir()
    (root / "step-000000003").symlink_to(other / "step-000000010", target_is_directory=True)
    model = _save(root, [5, 6], keep_last=1)  # retention removes leftovers below the step committed
    assert fingerprint(other) == before
    assert _entries(root) == ["step-000000006"]
    (root / "step-000000004").symlink_to(other / "step-000000010", target_is_directory=True)
    code, out = _gc(root)
    assert code == 0, out
    assert fingerprint(other) == before
    assert _entries(root) == ["step-000000006"]
    _restores(root, 6, model)


def test_a_linked_step_is_not_a_checkpoint_of_this_root(root, tmp_path) -> None:
    other, before = _other_run(tmp_path)
    model = _save(root, [5])
    (root / "step-000000010").symlink_to(other / "step-000000010", target_is_directory=True)
    with CheckpointManager(root, {"model": _model(0.0)}) as mgr:
        assert mgr.steps() == [5]
    _restores(root, 5, model)
    assert fingerprint(other) == before


# -- links and hard links inside leftovers --------------------------------------------------------


def _leftover_with_links(step_dir: Path, top: Path) -> None:
    step_dir.mkdir(parents=True)
    (step_dir / "Linear.0.10.pt").symlink_to(top / "precious.bin")
    (step_dir / "sub").symlink_to(top / "sub", target_is_directory=True)
    (step_dir / "nested").mkdir()
    (step_dir / "nested" / "notes.txt").symlink_to(top / "notes.txt")
    os.link(top / "sub" / "data.pt", step_dir / "nested" / "data.pt")
    os.link(top / "precious.bin", step_dir / "checkpoint.0.10.pt")


def test_a_save_clears_a_leftover_of_links_without_following_them(root, outside) -> None:
    """An uncommitted leftover of step 10 holding links and hard links to outside files, some under
    the names the save writes: the save removes them as names and writes new files."""
    top, check = outside
    _leftover_with_links(root / "step-000000010", top)
    model = _save(root, [10])
    check()
    _restores(root, 10, model)


def test_retention_and_gc_clear_leftovers_of_links_without_following_them(root, outside) -> None:
    top, check = outside
    _leftover_with_links(root / "step-000000003", top)
    model = _save(root, [5], keep_last=1)
    assert _entries(root) == ["step-000000005"]
    _leftover_with_links(root / "step-000000004", top)
    code, out = _gc(root)
    assert code == 0, out
    check()
    assert _entries(root) == ["step-000000005"]
    _restores(root, 5, model)


# -- the Store refuses paths through links ------------------------------------------------------


def test_the_store_never_writes_or_deletes_through_a_link(root, outside) -> None:
    top, check = outside
    root.mkdir()
    (root / "step-000000010").symlink_to(top, target_is_directory=True)
    store = Store(root)
    with pytest.raises(LinkedPathError, match="step-000000010"):
        store.write_bytes("step-000000010/precious.bin", b"x")
    with pytest.raises(LinkedPathError, match="step-000000010"):
        store.open_write("step-000000010/new.pt")
    with pytest.raises(LinkedPathError, match="step-000000010"):
        store.makedirs("step-000000010/deeper")
    with pytest.raises(LinkedPathError, match="step-000000010"):
        store.remove("step-000000010/notes.txt")
    with pytest.raises(LinkedPathError, match="step-000000010"):
        store.remove_tree("step-000000010/sub")
    assert not store.exists("step-000000010/notes.txt") and store.list_dir("step-000000010") == []
    assert store.is_link("step-000000010") and store.exists("step-000000010")
    store.remove_tree("step-000000010")  # the link itself
    assert not os.path.lexists(root / "step-000000010")
    check()


def test_the_store_writes_a_new_file_over_a_hard_link(root, outside) -> None:
    top, check = outside
    (root / "step-000000001").mkdir(parents=True)
    os.link(top / "notes.txt", root / "step-000000001" / "manifest.json")
    os.link(top / "precious.bin", root / "step-000000001" / "data.pt")
    store = Store(root)
    store.write_bytes("step-000000001/manifest.json", b"{}")
    with store.open_write("step-000000001/data.pt", expected_bytes=1 << 20) as f:
        f.write(b"new bytes")
    assert (root / "step-000000001" / "manifest.json").read_bytes() == b"{}"
    assert (root / "step-000000001" / "data.pt").read_bytes() == b"new bytes"
    check()
