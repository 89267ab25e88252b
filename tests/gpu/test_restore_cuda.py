"""CUDA restore through each host->device copy path: bit-exact, in place.

The paths: the pinned bounce (:mod:`checkpointd.restore.bounce`) through the native upload or the Python
bounce, and one ``copy_`` per pair (below ``bulkcopy.AUTO_MIN_BYTES``); ``auto`` is the library's own
choice. A CUDA model with a channels_last conv weight and fused AdamW is saved, then restored into
(a) the same live objects with scrambled state, whose state tensors must be written in place, and
(b) a fresh optimizer with no state; the result must equal the saved state in type, dtype, device,
strides and bits. Skipped where CUDA is unavailable.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from checkpointd import CheckpointManager
from checkpointd.native import upload as upload_native
from checkpointd.restore import bounce, bulkcopy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PATHS = ["auto", "bounce-native", "bounce-python", "per-pair"]
UPLOADS = ["native", "python"]


def _use(monkeypatch, upload: str) -> None:
    """The bounce natively (:mod:`checkpointd.native.upload`, wherever it builds) or in Python (as without it)."""
    if upload == "python":
        monkeypatch.setattr(upload_native, "library", lambda: None)
    assert bounce.uploads_off_gil() == (upload == "native"), upload_native.why_not


def _path(monkeypatch, path: str) -> None:
    """Restores copy through ``path`` (see the module docstring)."""
    if path == "per-pair":
        monkeypatch.setattr(bulkcopy, "AUTO_MIN_BYTES", 1 << 62)
    elif path.startswith("bounce"):
        monkeypatch.setattr(bulkcopy, "AUTO_MIN_BYTES", 0)
        _use(monkeypatch, path.split("-", 1)[1])


def _model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 16, 3), nn.BatchNorm2d(16), nn.Flatten(), nn.Linear(16 * 30 * 30, 2048),
                      nn.Linear(2048, 2048))
    m = m.cuda()
    m[0].to(memory_format=torch.channels_last)
    return m


def _trained():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    for _ in range(2):
        model(torch.randn(2, 3, 32, 32, device="cuda")).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _scramble(model, opt) -> None:
    with torch.no_grad():
        for t in model.state_dict().values():
            t.fill_(3)
        for st in opt.state.values():
            for v in st.values():
                v.fill_(7)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8).cpu()


def _assert_same(a_model, a_opt, b_model, b_opt) -> None:
    sa, sb = a_model.state_dict(), b_model.state_dict()
    for k in sa:
        assert (sa[k].dtype, sa[k].device, sa[k].stride()) == (sb[k].dtype, sb[k].device, sb[k].stride()), k
        assert torch.equal(_bits(sa[k]), _bits(sb[k])), k
    for p, q in zip(a_model.parameters(), b_model.parameters()):
        x, y = a_opt.state[p], b_opt.state[q]
        assert x.keys() == y.keys()
        for key in x:
            u, v = x[key], y[key]
            assert (type(u), u.dtype, u.device, u.shape, u.stride()) == (type(v), v.dtype, v.device, v.shape, v.stride()), key
            assert torch.equal(_bits(u), _bits(v)), key
    assert [{k: v for k, v in g.items() if k != "params"} for g in a_opt.param_groups] == \
        [{k: v for k, v in g.items() if k != "params"} for g in b_opt.param_groups]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    model, opt = _trained()
    with CheckpointManager(str(root), {"model": model, "optim": opt}, compression=None) as mgr:
        mgr.save(1)
        mgr.wait()
    ref_model, ref_opt = copy.deepcopy((model, opt))  # together: the copy's state is keyed by the copied params
    return str(root), ref_model, ref_opt


@pytest.mark.parametrize("path", PATHS)
def test_restore_into_live_optimizer_in_place(saved, monkeypatch, path) -> None:
    root, ref_model, ref_opt = saved
    _path(monkeypatch, path)
    model, opt = _trained()
    _scramble(model, opt)
    held = {id(p): dict(opt.state[p]) for p in model.parameters()}
    with CheckpointManager(root, {"model": model, "optim": opt}, compression=None) as mgr:
        assert mgr.restore_latest() == 1
    torch.cuda.synchronize()
    _assert_same(ref_model, ref_opt, model, opt)
    assert model[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert opt.state[model[0].weight]["exp_avg"].is_contiguous(memory_format=torch.channels_last)
    for p in model.parameters():
        for key, t in held[id(p)].items():
            assert opt.state[p][key] is t, f"{key} was replaced, not written in place"


@pytest.mark.parametrize("path", PATHS)
def test_restore_into_fresh_optimizer(saved, monkeypatch, path) -> None:
    root, ref_model, ref_opt = saved
    _path(monkeypatch, path)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    with CheckpointManager(root, {"model": model, "optim": opt}, compression=None) as mgr:
        assert mgr.restore_latest() == 1
    torch.cuda.synchronize()
    _assert_same(ref_model, ref_opt, model, opt)
    # and training goes on identically from both (on a copy: the reference is shared by the tests)
    ref_model, ref_opt = copy.deepcopy((ref_model, ref_opt))
    x = torch.randn(2, 3, 32, 32, device="cuda")
    for m, o in ((ref_model, ref_opt), (model, opt)):
        m(x).square().mean().backward()
        o.step()
    _assert_same(ref_model, ref_opt, model, opt)


@pytest.mark.parametrize("upload", UPLOADS)
def test_bounce_copies_dtype_cast_and_layout_change(monkeypatch, upload) -> None:
    _path(monkeypatch, f"bounce-{upload}")
    src = torch.randn(64, 3, 5, 5)
    dst_cl = torch.empty(64, 3, 5, 5, device="cuda").to(memory_format=torch.channels_last)
    dst_bf = torch.empty(64, 3, 5, 5, device="cuda", dtype=torch.bfloat16)
    big_src = torch.randn(9 << 20)
    big_dst = torch.empty_like(big_src, device="cuda")
    bulkcopy.copy_pairs([(dst_cl, src), (dst_bf, src), (big_dst, big_src)])
    torch.cuda.synchronize()
    assert torch.equal(dst_cl.cpu(), src) and dst_cl.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(dst_bf.cpu(), src.to(torch.bfloat16))
    assert torch.equal(big_dst.cpu(), big_src)


@pytest.mark.parametrize("upload", UPLOADS)
def test_bounce_packs_many_small_pairs_exactly(monkeypatch, upload) -> None:
    """Pairs below ``PACK_BELOW_BYTES`` share chunks (gathered, one DMA, scattered on the device): with
    1 MiB chunks, 200 small tensors of mixed dtypes fill many more packs than the ring has chunks. (The
    native upload packs nothing: each pair its own pieces.)"""
    _path(monkeypatch, f"bounce-{upload}")
    monkeypatch.setattr(bounce, "CHUNK_BYTES", 1 << 20)
    g = torch.Generator().manual_seed(0)
    srcs = []
    for i in range(200):
        n = int(torch.randint(1, 60_000, (1,), generator=g))
        dtype = (torch.float32, torch.bfloat16, torch.int64, torch.uint8)[i % 4]
        srcs.append(torch.randint(0, 100, (n,), generator=g).to(dtype))
    srcs.insert(50, torch.randn(3 << 20, generator=g))  # large pairs between them keep their own chunks
    srcs.append(torch.randn(1 << 18, generator=g))  # exactly 1 MiB: not packed
    dsts = [torch.full_like(s, 7, device="cuda") for s in srcs]
    bulkcopy.copy_pairs(list(zip(dsts, srcs)))
    for d, s in zip(dsts, srcs):
        assert d.dtype == s.dtype and torch.equal(d.cpu(), s)


@pytest.mark.parametrize("upload", UPLOADS)
def test_bounce_under_one_intra_op_thread_is_exact_and_puts_the_setting_back(monkeypatch, upload) -> None:
    """``torchrun`` sets one intra-op thread per rank: the bounce raises it for its copies, then restores it."""
    _path(monkeypatch, f"bounce-{upload}")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        srcs = [torch.randn(n) for n in (5, 1 << 20, (7 << 20) + 3, 40 << 20)]  # some span several chunks
        dsts = [torch.empty_like(s, device="cuda") for s in srcs]
        bulkcopy.copy_pairs(list(zip(dsts, srcs)))
        assert torch.get_num_threads() == 1
        for d, s in zip(dsts, srcs):
            assert torch.equal(d.cpu(), s)
    finally:
        torch.set_num_threads(before)


def test_bounce_pool_is_unpinned_once_a_save_has_committed(saved, monkeypatch) -> None:
    """Pinned memory after a resume stays the staging arena's (at most 1.05x the state)."""
    root, ref_model, ref_opt = saved
    monkeypatch.setattr(bulkcopy, "AUTO_MIN_BYTES", 0)
    model, opt = _trained()
    with CheckpointManager(root, {"model": model, "optim": opt}, compression=None) as mgr:
        assert mgr.restore_latest() == 1
        assert bounce._pools, "the restore went through the bounce pool"  # (its chunks may be gone already)
        model(torch.randn(2, 3, 32, 32, device="cuda")).square().mean().backward()
        opt.step()
        mgr.save(2)
        mgr.wait()
        assert all(p.pinned is None for p in bounce._pools.values()), "bounce chunks still pinned after the save"
