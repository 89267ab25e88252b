"""Bulk in-place apply (``restore_apply`` + ``bulkcopy``): same result as the per-entry path, in place.

The placement logic normally runs only for parameters on a GPU; ``restore_apply.PLACE_ON_CPU`` runs it
on CPU here, so every comparison below exercises the code a CUDA restore takes (tests/gpu repeats
them on a GPU).
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn as nn

from checkpointd import CheckpointManager
from checkpointd.restore import bounce, bulkcopy
from checkpointd.restore import apply as restore_apply
from checkpointd.restore.per_entry import apply_entry, match_optimizer_state_layout
from checkpointd.errors import CorruptCheckpointError, StateMismatchError
from checkpointd.state import classify, Entry


@pytest.fixture(autouse=True)
def _place_on_cpu(monkeypatch):
    monkeypatch.setattr(restore_apply, "PLACE_ON_CPU", True)


def _model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Flatten(), nn.Linear(8 * 4 * 4, 5))
    m[0].to(memory_format=torch.channels_last)
    return m


def _trained(fused: bool = False):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    for _ in range(2):
        model(torch.randn(4, 3, 6, 6)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _roundtrip(obj):
    """What a restore sees: the stored state dict loaded back by the weights-only loader."""
    raw = io.BytesIO()
    torch.save(obj, raw)
    raw.seek(0)
    return torch.load(raw, weights_only=True)


def _scramble(model, opt) -> None:
    with torch.no_grad():
        for t in list(model.state_dict().values()):
            t.fill_(3) if t.is_floating_point() else t.fill_(11)
        for st in opt.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    v.fill_(7)
        for g in opt.param_groups:
            g["lr"] = 0.5


def _entries(model, opt) -> list[Entry]:
    return [Entry("model", model, classify("model", model)), Entry("optim", opt, classify("optim", opt))]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8) if t.dim() else t.detach().reshape(1).view(torch.uint8)


def _assert_same(a_model, a_opt, b_model, b_opt) -> None:
    sa, sb = a_model.state_dict(), b_model.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and sa[k].stride() == sb[k].stride() and torch.equal(_bits(sa[k]), _bits(sb[k])), k
    pa, pb = list(a_model.parameters()), list(b_model.parameters())
    assert len(a_opt.state) == len(b_opt.state)
    for p, q in zip(pa, pb):
        x, y = a_opt.state[p], b_opt.state[q]
        assert x.keys() == y.keys()
        for key in x:
            u, v = x[key], y[key]
            assert type(u) is type(v), key
            if isinstance(u, torch.Tensor):
                assert (u.dtype, u.device, u.shape, u.stride()) == (v.dtype, v.device, v.shape, v.stride()), key
                assert torch.equal(_bits(u), _bits(v)), key
            else:
                assert u == v
    ga = [{k: v for k, v in g.items() if k != "params"} for g in a_opt.param_groups]
    gb = [{k: v for k, v in g.items() if k != "params"} for g in b_opt.param_groups]
    assert ga == gb


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("fresh", [False, True])
def test_bulk_apply_matches_the_per_entry_path(monkeypatch, fused, fresh) -> None:
    model, opt = _trained(fused)
    saved = _roundtrip({"model": model.state_dict(), "optim": opt.state_dict()})
    live = []
    for _ in range(2):
        m = copy.deepcopy(model)
        o = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=fused)
        if not fresh:
            o.load_state_dict(copy.deepcopy(opt.state_dict()))
            restore_apply_match(o)
            _scramble(m, o)
        live.append((m, o))
    (ma, oa), (mb, ob) = live
    old_state = {id(p): dict(ob.state[p]) for p in mb.parameters()} if not fresh else {}
    params_before = [p for p in mb.parameters()]
    for e in _entries(ma, oa):  # the per-entry path: each object's own load_state_dict
        apply_entry(e, saved[e.name])
    restore_apply.apply_entries(_entries(mb, ob), {"model": saved["model"], "optim": saved["optim"]})
    _assert_same(ma, oa, mb, ob)
    _assert_same(model, opt, mb, ob)
    assert [p for p in mb.parameters()] == params_before
    assert mb[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert ob.state[mb[0].weight]["exp_avg"].is_contiguous(memory_format=torch.channels_last)
    for p in mb.parameters():  # existing state tensors were written in place, not replaced
        for key, t in old_state.get(id(p), {}).items():
            if key != "step" or fused:
                assert ob.state[p][key] is t, key


def restore_apply_match(opt) -> None:

    match_optimizer_state_layout(opt)


def test_step_tensor_does_not_keep_the_read_buffer_alive(monkeypatch) -> None:
    model, opt = _trained(fused=False)
    saved = _roundtrip({"model": model.state_dict(), "optim": opt.state_dict()})
    # one big storage under every tensor, as the fast loader gives
    big = torch.empty(1 << 20, dtype=torch.float32)
    big[3] = 2.0
    for st in saved["optim"]["state"].values():
        st["step"] = big[3:4].reshape(())
    m = copy.deepcopy(model)
    o = torch.optim.AdamW(m.parameters(), lr=1e-3)
    restore_apply.apply_entries(_entries(m, o), {"model": saved["model"], "optim": saved["optim"]})
    for st in o.state.values():
        assert st["step"].item() == 2.0
        assert st["step"].untyped_storage().nbytes() < 1024


def test_mismatched_optimizer_is_refused_and_live_state_untouched(tmp_path) -> None:
    model, opt = _trained()
    with CheckpointManager(str(tmp_path), {"model": model, "optim": opt}, compression=None) as mgr:
        mgr.save(1)
        mgr.wait()
    m2, o2 = _trained()
    o2.add_param_group({"params": [nn.Parameter(torch.zeros(3))]})
    _scramble(m2, o2)
    before = copy.deepcopy((m2.state_dict(), o2.state_dict()))
    with CheckpointManager(str(tmp_path), {"model": m2, "optim": o2}, compression=None) as mgr:
        with pytest.raises(StateMismatchError, match="parameter groups"):
            mgr.restore(1)
    after = (m2.state_dict(), o2.state_dict())
    for k, v in before[0].items():
        assert torch.equal(v, after[0][k])
    for pid, st in before[1]["state"].items():
        for key, v in st.items():
            assert torch.equal(v, after[1]["state"][pid][key])


def test_tampered_newest_step_falls_back_and_is_never_applied(tmp_path) -> None:
    model, opt = _trained()
    with CheckpointManager(str(tmp_path), {"model": model, "optim": opt}, compression=None, keep_last=None) as mgr:
        mgr.save(1)
        mgr.wait()
        ref = copy.deepcopy((model, opt))
        model(torch.randn(4, 3, 6, 6)).square().mean().backward()
        opt.step()
        mgr.save(2)
        mgr.wait()
    step_dir = tmp_path / "step-000000002"
    for victim in sorted(f for f in step_dir.iterdir() if f.name not in ("manifest.json", "COMMITTED")):
        data = bytearray(victim.read_bytes())
        data[len(data) * 2 // 3] ^= 0x10
        victim.write_bytes(bytes(data))
    import shutil

    tampered = tmp_path.parent / f"{tmp_path.name}-tampered"
    shutil.copytree(step_dir, tampered)
    _scramble(model, opt)
    with CheckpointManager(str(tmp_path), {"model": model, "optim": opt}, compression=None) as mgr:
        with pytest.warns(RuntimeWarning, match="skipping step 2"):
            assert mgr.restore_latest() == 1
    _assert_same(ref[0], ref[1], model, opt)
    assert not step_dir.exists()  # taken out of the checkpoints once step 1 restored
    # only the tampered step left: refused, nothing applied
    shutil.rmtree(tmp_path / "step-000000001")
    shutil.copytree(tampered, step_dir)
    _scramble(model, opt)
    scrambled = copy.deepcopy((model, opt))
    with CheckpointManager(str(tmp_path), {"model": model, "optim": opt}, compression=None) as mgr:
        with pytest.raises(CorruptCheckpointError), pytest.warns(RuntimeWarning):
            mgr.restore_latest()
    _assert_same(scrambled[0], scrambled[1], model, opt)


def test_manager_round_trip(tmp_path) -> None:
    model, opt = _trained(fused=True)
    ref = copy.deepcopy((model, opt))
    with CheckpointManager(str(tmp_path), {"model": model, "optim": opt, "t": torch.arange(4.0)}, compression=None) as mgr:
        mgr.save(1)
        mgr.wait()
    m2 = _model()
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-2, fused=True)
    t = torch.zeros(4)
    with CheckpointManager(str(tmp_path), {"model": m2, "optim": o2, "t": t}, compression=None) as mgr:
        assert mgr.restore_latest() == 1
    _assert_same(ref[0], ref[1], m2, o2)
    assert torch.equal(t, torch.arange(4.0))


def test_custom_module_and_hooks_take_the_per_entry_path(monkeypatch) -> None:
    calls = []

    class Custom(nn.Linear):
        def _load_from_state_dict(self, *args, **kwargs):
            calls.append("custom")
            return super()._load_from_state_dict(*args, **kwargs)

    m = nn.Sequential(Custom(3, 3))
    saved = _roundtrip(m.state_dict())
    m2 = nn.Sequential(Custom(3, 3))
    restore_apply.apply_entries([Entry("m", m2, "module")], {"m": saved})
    assert calls == ["custom"] and torch.equal(m2[0].weight, m[0].weight)
    o = torch.optim.SGD(m2.parameters(), lr=0.1, momentum=0.9)
    o.register_load_state_dict_pre_hook(lambda opt, sd: calls.append("hook"))
    restore_apply.apply_entries([Entry("o", o, "optimizer")], {"o": _roundtrip(o.state_dict())})
    assert calls[-1] == "hook"


def test_intra_op_threads_are_raised_for_the_block_and_put_back() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with bounce._intra_op_threads(2):
            assert torch.get_num_threads() == 2
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)
        with bounce._intra_op_threads(1):  # never lowered
            assert torch.get_num_threads() == 2
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("cpus, ranks, threads", [(16, 1, 12), (2, 1, 2), (128, 8, 12), (64, 1, 16), (None, 1, 2)])
def test_copy_threads_leave_a_quarter_of_the_processs_cores(monkeypatch, cpus, ranks, threads) -> None:
    """The bounce's copy threads default to three quarters of this process's share of the cores (the rest
    plan and parse beside the uploads), at least 2 and at most 16; a set number wins."""
    monkeypatch.setattr(bounce.os, "cpu_count", lambda: cpus)
    monkeypatch.setattr(bounce, "local_ranks", lambda: ranks)
    monkeypatch.setattr(bounce, "COPY_THREADS", None)
    assert bounce.copy_threads() == threads
    monkeypatch.setattr(bounce, "COPY_THREADS", 5)
    assert bounce.copy_threads() == 5


def test_bulkcopy_helpers() -> None:
    x = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    assert bulkcopy.is_dense(x) and bulkcopy.is_dense(torch.randn(3)) and not bulkcopy.is_dense(torch.randn(4, 4)[:, :2])
    assert torch.equal(bulkcopy.flat_bytes(x), x.permute(0, 2, 3, 1).contiguous().view(-1).view(torch.uint8))
    dst = [torch.empty_like(x), torch.zeros(3, dtype=torch.float64)]
    bulkcopy.copy_pairs([(dst[0], x), (dst[1], torch.arange(3, dtype=torch.float32))])
    assert torch.equal(dst[0], x) and dst[0].stride() == x.stride() and dst[1].tolist() == [0.0, 1.0, 2.0]


def test_small_pairs_are_packed_in_order_within_a_chunk() -> None:
    """The bounce packs pairs below ``PACK_BELOW_BYTES`` into chunks: every pair once, in order, none over."""
    sizes = [5, 700, 300, 1, 999, 1000, 2, 600, 400]
    items = [(torch.empty(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)) for n in sizes]
    packs = bounce._packs(items, 1000)
    assert [p for pack in packs for p in pack] == items
    assert all(sum(d.numel() for d, _ in pack) <= 1000 for pack in packs)
    assert [[d.numel() for d, _ in pack] for pack in packs] == [[5, 700], [300, 1], [999], [1000], [2, 600], [400]]
    assert bounce._packs([], 1000) == []
