"""Bad input catalogue: each case gives a clear error (checked with ``match=``) and loses nothing.

Bad state raises from ``maybe_save`` (or the constructor) before anything is written; a root that is a
file or cannot be written to fails clearly; foreign, truncated or oddly named entries in a root are
ignored by ``steps()``/``restore_latest()``/retention/``gc`` and never deleted unless they are our own
uncommitted leftovers."""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest
import torch

from checkpointd import CheckpointError, CheckpointManager, CheckpointWriteError, IOOptions
from checkpointd.cleanup import collect_garbage
from checkpointd.storage.store import Store
from checkpointd.testing import Fault, FaultPlan, permanent_error


def _good_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    return {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1), "data": {"v": 1}}


def _with_one_checkpoint(tmp_path) -> tuple[CheckpointManager, dict[str, Any]]:
    state = _good_state()
    mgr = CheckpointManager(tmp_path / "ckpt", state, keep_last=None)
    mgr.save(1)
    mgr.wait()
    return mgr, state


def _files(root) -> set[str]:
    return {os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs}


_BAD_VALUES = {
    "unserializable object": (lambda: threading.Lock(), r"data\b.*(lock|Lock)"),
    "a function": (lambda: (lambda x: x), r"function|lambda"),
    "meta tensor": (lambda: torch.empty(3, device="meta"), r"meta tensor.*materialize"),
    "sparse tensor": (lambda: torch.eye(3).to_sparse(), r"layout.*to_dense"),
    "non-string key": (lambda: {b"k": 1.0}, r"key of type bytes.*use str or int keys"),
    "open file": (lambda: open(os.devnull, "rb"), r"data\b"),
}


@pytest.mark.parametrize("case", sorted(_BAD_VALUES))
def test_bad_value_in_state_raises_from_maybe_save_and_loses_nothing(tmp_path, case):
    make, pattern = _BAD_VALUES[case]
    mgr, state = _with_one_checkpoint(tmp_path)
    before = _files(tmp_path / "ckpt")
    state["data"]["bad"] = make()  # a registered plain-data dict grows a bad value
    with pytest.raises(CheckpointError, match=pattern):
        mgr.save(2)
    assert _files(tmp_path / "ckpt") == before  # nothing written
    assert mgr.steps() == [1]
    del state["data"]["bad"]
    mgr.save(3)  # fixed: saving works again
    mgr.close()
    with CheckpointManager(tmp_path / "ckpt", _good_state()) as check:
        assert check.steps() == [1, 3]
        assert check.restore_latest() == 3


def test_meta_module_raises_clearly(tmp_path):
    with torch.device("meta"):
        model = torch.nn.Linear(4, 4)
    mgr = CheckpointManager(tmp_path / "ckpt", {"model": model})
    with pytest.raises(CheckpointError, match=r"meta tensor.*materialize"):
        mgr.save(1)
    assert mgr.steps() == []
    mgr.close()


@pytest.mark.parametrize("key", [1, ("a",), None, ""])
def test_non_string_top_level_key_raises_at_construction(tmp_path, key):
    with pytest.raises(CheckpointError, match="non-empty strings"):
        CheckpointManager(tmp_path / "ckpt", {key: torch.zeros(1)})
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())


def test_new_key_in_a_registered_dict_saves_and_restores(tmp_path):
    mgr, state = _with_one_checkpoint(tmp_path)
    state["data"]["new"] = [1, 2, 3]
    mgr.save(2)
    mgr.close()
    live = _good_state()
    with CheckpointManager(tmp_path / "ckpt", live) as check:
        assert check.restore_latest() == 2
        assert live["data"] == {"v": 1, "new": [1, 2, 3]}
        check.restore(1)  # the older structure restores too (plain data is replaced in place)
        assert live["data"] == {"v": 1}


def test_param_added_to_the_optimizer_saves_and_restores_clearly(tmp_path):
    mgr, state = _with_one_checkpoint(tmp_path)
    extra = torch.nn.Parameter(torch.ones(3))
    state["opt"].add_param_group({"params": [extra], "lr": 0.5})
    extra.grad = torch.ones(3)
    state["opt"].step()
    mgr.save(2)
    mgr.close()
    # a live optimizer with the same structure restores step 2
    live = _good_state()
    live["opt"].add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))], "lr": 0.1})
    with CheckpointManager(tmp_path / "ckpt", live) as check:
        assert check.restore_latest() == 2
        assert live["opt"].param_groups[1]["lr"] == 0.5
        # one with the old structure cannot take step 2: a clear error, and nothing was loaded
        old = _good_state()
        with CheckpointManager(tmp_path / "ckpt", old) as check_old:
            with pytest.raises(CheckpointError, match=r"(?i)param|group|optimizer"):
                check_old.restore(2)
            check_old.restore(1)


def test_tensor_replaced_by_a_different_shape_restores_with_a_clear_error(tmp_path):
    state = {"t": torch.zeros(4)}
    with CheckpointManager(tmp_path / "ckpt", state) as mgr:
        mgr.save(1)
    with CheckpointManager(tmp_path / "ckpt", {"t": torch.zeros(5)}) as mgr:
        with pytest.raises(CheckpointError, match=r"shape|size"):
            mgr.restore_latest()


def test_root_that_is_a_file(tmp_path):
    f = tmp_path / "not-a-dir"
    f.write_text("hello")
    with pytest.raises(CheckpointError, match=r"is a file.*directory"):
        CheckpointManager(f, {"t": torch.zeros(1)})
    assert f.read_text() == "hello"


def test_root_under_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    mgr = CheckpointManager(f / "sub", {"t": torch.zeros(1)}, io=IOOptions(retry_timeout_secs=1))
    with pytest.raises(CheckpointWriteError, match=r"(?i)not a directory|file is in the way"):
        mgr.save(1)  # the root's lease cannot be taken: refused before anything is staged
    mgr.close()
    assert f.read_text() == "x"


def test_no_permission_fails_fast_and_clearly(tmp_path):
    plan = FaultPlan()
    state = _good_state()
    mgr = CheckpointManager(f"faulty://{tmp_path}/ckpt", state, io=IOOptions(retry_timeout_secs=60),
                            storage_options={"target_protocol": "file", "faults": plan})
    mgr.save(1)
    mgr.wait()
    plan.add(Fault(op=("open", "rm"), error=permanent_error))
    mgr.save(2)
    with pytest.raises(CheckpointWriteError, match=r"step 2 .*PermissionError.*may write to the checkpoint root"):
        mgr.wait()
    assert mgr.steps() == [1]
    plan.clear()
    mgr.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to mount a read-only tmpfs")
def test_read_only_root(tmp_path):
    import subprocess

    mnt = tmp_path / "ro"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount tmpfs")
    try:
        mgr = CheckpointManager(mnt / "ckpt", {"t": torch.zeros(1)}, io=IOOptions(retry_timeout_secs=5))
        with pytest.raises(CheckpointWriteError, match=r"Read-only file system"):
            mgr.save(1)  # refused at once when the root's lease cannot be taken, else by the background write
            mgr.wait()
        mgr.close()
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def _entries(root) -> list[str]:
    """The names in ``root``, the library's own bookkeeping (``.checkpointd-*``: its lease) aside."""
    return sorted(p.name for p in root.iterdir() if not p.name.startswith(".checkpointd"))


def _litter(root) -> None:
    (root / "garbage.txt").write_text("not ours")
    (root / "step-abc").mkdir()
    (root / "step-abc" / "x").write_text("y")
    (root / "step-000000005").mkdir()
    (root / "step-000000005" / "manifest.json").write_text('{"step": 5, "fil')  # truncated, no marker
    (root / "step-000000006").mkdir()
    (root / "step-000000006" / "COMMITTED").write_bytes(b"")  # killed while committing
    (root / "notes").mkdir()
    (root / "notes" / "COMMITTED").write_text("{}")  # a foreign marker outside a step dir


def test_foreign_and_truncated_entries_in_the_root(tmp_path):
    root = tmp_path / "ckpt"
    state = _good_state()
    with CheckpointManager(root, state, keep_last=None) as mgr:
        mgr.save(1)
        mgr.wait()
        _litter(root)
        assert mgr.steps() == [1]
    live = _good_state()
    with CheckpointManager(root, live, keep_last=2) as mgr:
        assert mgr.steps() == [1]
        assert mgr.restore_latest() == 1
        for step in (7, 8, 9):
            mgr.save(step)
        mgr.wait()
        assert mgr.steps() == [8, 9]
    # our own uncommitted leftovers (5, 6) went with retention; foreign entries are untouched
    assert _entries(root) == ["garbage.txt", "notes", "step-000000008", "step-000000009", "step-abc"]
    assert (root / "garbage.txt").read_text() == "not ours" and (root / "step-abc" / "x").read_text() == "y"


def test_gc_ignores_foreign_entries(tmp_path):
    root = tmp_path / "ckpt"
    with CheckpointManager(root, _good_state()) as mgr:
        mgr.save(1)
    _litter(root)
    results = collect_garbage(Store(root), older_than_secs=0)
    removed = sorted(r.step for r in results if r.action == "removed")
    assert removed == [5, 6]
    assert _entries(root) == ["garbage.txt", "notes", "step-000000001", "step-abc"]
    with CheckpointManager(root, _good_state()) as mgr:
        assert mgr.restore_latest() == 1


def test_a_root_with_only_leftovers_restores_none(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    _litter(root)
    with CheckpointManager(root, _good_state()) as mgr:
        assert mgr.steps() == []
        assert mgr.restore_latest() is None


def test_validation_keeps_its_rules_on_the_fast_path():
    """The per-save validation checks plain tensors and common atoms inline; what it accepts and refuses
    stays as it was: str subclasses are string keys, meta tensors and non-string module keys are refused."""
    from checkpointd.errors import StateError
    from checkpointd.state import validate_tree

    class Name(str):
        pass

    validate_tree({Name("w"): torch.ones(2), "n": [1, 2.0, None, True, "s", torch.zeros(1)]}, "state['m']", module_keys=True)
    with pytest.raises(StateError, match=r"state\['m'\] has a non-string key 1 \(int\)"):
        validate_tree({"a": torch.ones(1), 1: torch.ones(1)}, "state['m']", module_keys=True)
    with pytest.raises(StateError, match=r"state\['d'\]\['x'\]\[1\] is a meta tensor"):
        validate_tree({"x": [torch.ones(1), torch.empty(2, device="meta")]}, "state['d']")
