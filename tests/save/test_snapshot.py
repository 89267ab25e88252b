"""Snapshot isolation (SPEC §2 "What a save captures"): a save of step s holds the values at the
``maybe_save(s)`` call, whatever the training loop does to the live state afterwards.

The background writer is slowed down (a delay fault on every file it opens) so the mutations below
certainly happen before any byte of the checkpoint is serialized.
"""

from __future__ import annotations

import copy

import pytest
import torch

from checkpointd.save import planning
from checkpointd import CheckpointManager, load
from checkpointd.testing.faults import Fault, FaultPlan
from tree_compare import assert_tree_equal


def _clone(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone(v) for v in obj]
    return copy.deepcopy(obj)


def _slow_root(tmp_path, delay=0.5):
    plan = FaultPlan(Fault(op="open", error=None, delay_secs=delay, path="*step-*"))
    return f"faulty://{tmp_path}/ckpt", {"target_protocol": "file", "faults": plan}, plan


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_mutation_after_maybe_save_does_not_leak(tmp_path, compression):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3), torch.nn.BatchNorm2d(3)).to(memory_format=torch.channels_last)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 2, 5, 5)).sum().backward()
    opt.step()
    counter = torch.arange(6, dtype=torch.float64)
    data = {"tensor": torch.ones(4), "number": 1, "nested": {"items": [1, 2], "t": torch.zeros(2, dtype=torch.int32)}}
    items = [torch.full((3,), 7.0), "a"]

    root, options, plan = _slow_root(tmp_path)
    mgr = CheckpointManager(root, {"model": model, "optimizer": opt, "counter": counter, "data": data, "items": items},
                            compression=compression, storage_options=options)
    expected = {
        "model": _clone(model.state_dict()),
        "optimizer": _clone(opt.state_dict()),
        "counter": counter.clone(),
        "data": _clone(data),
        "items": _clone(items),
    }
    assert mgr.maybe_save(1, force=True)
    closed = plan.calls["close"]  # the root's lease, written by the first save before it returns

    # Mutate everything in place, by every route a training loop takes.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1)
        for st in opt.state.values():
            for v in st.values():
                v.add_(1)
    model.train()
    model(torch.randn(2, 2, 5, 5)).sum().backward()  # BatchNorm running stats move
    opt.step()
    opt.param_groups[0]["lr"] = 123.0
    counter.mul_(-1)
    data["tensor"].add_(5)
    data["number"] = 2
    data["new"] = "added later"
    data["nested"]["items"].append(3)
    data["nested"]["t"].fill_(9)
    items[0].zero_()
    items.append("b")
    assert plan.calls["close"] == closed, "the writer must still be blocked when the mutations happen"

    mgr.wait()
    mgr.close()
    got = load(tmp_path / "ckpt")
    assert_tree_equal(expected, got, strides=False)


def test_consecutive_saves_each_hold_their_own_values(tmp_path):
    """Reused staging buffers: save 2 is staged while save 1 is still being written (max_pending=2)."""
    t = torch.zeros(1000)
    root, options, _ = _slow_root(tmp_path, delay=0.2)
    with CheckpointManager(root, {"t": t}, keep_last=None, max_pending=2, storage_options=options) as mgr:
        for step in range(1, 4):
            t.fill_(step)
            assert mgr.maybe_save(step, force=True)
            t.fill_(-1)
    for step in range(1, 4):
        assert torch.equal(load(tmp_path / "ckpt", step=step)["t"], torch.full((1000,), float(step)))


def test_registered_tensor_view_is_stored_at_its_own_size(tmp_path):
    """A small view of a large storage is stored as its own bytes, not the whole storage."""
    big = torch.arange(1_000_000, dtype=torch.float32)
    view = big[500:510]
    strided = big[:40].view(4, 10)[:, ::3]  # not dense: staged contiguous
    with CheckpointManager(tmp_path, {"view": view, "strided": strided}, compression=None) as mgr:
        mgr.save(0)
    (step_dir,) = tmp_path.iterdir()
    data_file = step_dir / "checkpoint.0.0.pt"
    assert data_file.stat().st_size < 20_000  # the whole storage would be 4 MB
    got = torch.load(data_file, weights_only=True)
    assert torch.equal(got["view"], view)
    assert got["view"].untyped_storage().nbytes() == 40
    assert torch.equal(got["strided"], strided)


def test_buffers_prepared_ahead_are_pickled_there_so_the_first_save_hits_the_cache(tmp_path) -> None:
    """The arena prepared ahead is pickled once on its thread: the first save's pickling finds every
    staging buffer's reduction cached (nothing built on the committer thread), and its files are exact."""
    import time

    from checkpointd import CheckpointManager, load

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    with CheckpointManager(tmp_path, {"model": model, "optimizer": opt}, compression=None) as mgr:
        mgr._prepare_pending_buffers()  # what the first optimizer step or restore does on a GPU run
        deadline = time.monotonic() + 30
        while mgr._snap._preparing and time.monotonic() < deadline:
            time.sleep(0.01)
        arena = mgr._snap._arenas[0]
        assert all(planning.REDUCTIONS.get(b, ("cpu",)) is not None for b in arena.buffers if b.numel())
        misses = planning.REDUCTIONS.misses
        mgr.save(1)
        mgr.wait()
        assert planning.REDUCTIONS.misses == misses
    restored = load(tmp_path, step=1)
    for k, v in model.state_dict().items():
        assert torch.equal(restored["model"][k], v), k
    for k, v in opt.state_dict()["state"][0].items():
        assert torch.equal(restored["optimizer"]["state"][0][k], v), k


def test_copy_events_that_host_threads_wait_for_sleep_instead_of_spinning(monkeypatch):
    """The events of the device-to-host copies (which the writer's thread waits for) are made with
    blocking synchronisation."""
    from checkpointd.save import device_copies

    made = []

    class FakeEvent:
        def __init__(self, enable_timing=False, blocking=False, interprocess=False):
            made.append(blocking)

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    device_copies.host_waited_event()
    assert made == [True]


def test_collect_tensors_stores_a_tensor_once_per_view():
    """Entries that are the same view of the same memory become one slot (tied weights); a different
    view starting at the same address (a row of a matrix, a reshape) and empty tensors stay separate."""
    from checkpointd.save.savejob import collect_tensors

    w = torch.randn(4, 6)
    tied = w.detach()  # another tensor object, the same view
    row0, flat, row1 = w[0], w.view(24), w[1]
    empty_a, empty_b = torch.empty(0), torch.empty(0)
    skeletons, tensors = collect_tensors([{"a": w, "b": tied, "row": row0}, [flat, empty_a, empty_b, row1]])
    slots = [skeletons[0]["a"], skeletons[0]["b"], skeletons[0]["row"], *skeletons[1]]
    assert slots[0].index == slots[1].index, "the same view is stored once"
    assert len({s.index for s in slots}) == 6
    assert [tensors[s.index] is t for s, t in zip(slots[2:], [row0, flat, empty_a, empty_b, row1])] == [True] * 5
    assert tensors[0] is w and len(tensors) == 6
