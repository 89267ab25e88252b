"""``serialize.plan_pt``/``write_pt``: the files ``torch.load(weights_only=True)`` reads back exactly."""

from __future__ import annotations

import io
import zipfile
from collections import OrderedDict

import pytest
import torch

from checkpointd.storage import ziplayout
from checkpointd.storage import ptlayout
from checkpointd.format.serialize import ReductionCache, plan_pt, storage_view, write_pt

DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
    torch.complex64, torch.complex128,
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.uint16, torch.uint32, torch.uint64,
]


class _Sink:
    def __init__(self) -> None:
        self.buf = io.BytesIO()
        self.hints: list = []
        self.dtype_hint = None

    def write(self, data) -> int:
        if self.dtype_hint is not None:
            self.hints.append(self.dtype_hint)
        return self.buf.write(bytes(data))


def _roundtrip(obj, dtypes=None):
    sink = _Sink()
    write_pt(plan_pt(obj), sink, dtypes)
    raw = sink.buf.getvalue()
    return torch.load(io.BytesIO(raw), weights_only=True), raw, sink


def _random(dtype, shape=(3, 5)):
    g = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype, generator=g)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 4).to(dtype)
    return torch.randint(0, 100, shape, generator=g).to(dtype)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_roundtrips_bit_exactly(dtype):
    t = _random(dtype)
    got, _, _ = _roundtrip({"t": t, "empty": torch.empty(0, 4, dtype=dtype), "scalar": t[0, 0].clone()})
    assert _bits_equal(got["t"], t)
    assert got["empty"].shape == (0, 4) and got["empty"].dtype == dtype
    assert _bits_equal(got["scalar"], t[0, 0]) and got["scalar"].dim() == 0


def test_nan_payloads_and_negative_zero_survive():
    t = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf")])
    t.view(torch.int32)[0] = 0x7FC00001  # a NaN with a payload
    got, _, _ = _roundtrip([t])
    assert torch.equal(got[0].view(torch.int32), t.view(torch.int32))


def test_strides_and_memory_formats_are_kept():
    cl = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    cl3d = torch.randn(2, 3, 2, 4, 5).to(memory_format=torch.channels_last_3d)
    transposed = torch.randn(6, 4).t()
    got, _, _ = _roundtrip({"cl": cl, "cl3d": cl3d, "t": transposed})
    for k, v in {"cl": cl, "cl3d": cl3d, "t": transposed}.items():
        assert got[k].stride() == v.stride(), k
        assert torch.equal(got[k], v), k


def test_shared_storage_is_written_once_and_stays_shared():
    base = torch.arange(20.0)
    a, b = base[:10], base[5:15].view(2, 5)
    got, raw, _ = _roundtrip({"base": base, "a": a, "b": b, "again": base})
    assert torch.equal(got["a"], a) and torch.equal(got["b"], b)
    assert got["a"].untyped_storage().data_ptr() == got["base"].untyped_storage().data_ptr()
    assert got["b"].storage_offset() == 5
    assert got["again"] is got["base"] or got["again"].data_ptr() == got["base"].data_ptr()
    members = [n for n in zipfile.ZipFile(io.BytesIO(raw)).namelist() if "/data/" in n]
    assert len(members) == 1


def test_plain_containers_and_atoms():
    obj = OrderedDict(
        a=1, b=2.5, c="s", d=None, e=True, f=[1, (2, 3)], g={"x": {1: "int key"}}, h=torch.Size([2, 3]),
        i=torch.float16, j=complex(1, 2), k=b"bytes", l=float("inf"),
    )
    got, _, _ = _roundtrip(obj)
    assert got == obj
    assert isinstance(got, OrderedDict) and list(got) == list(obj)


def test_parameter_roundtrips_as_tensor_data():
    p = torch.nn.Parameter(torch.randn(3))
    got, _, _ = _roundtrip({"p": p})
    assert torch.equal(got["p"], p.detach())


def test_dtype_hints_reach_the_sink():
    t16 = torch.randn(100).to(torch.bfloat16)
    t32 = torch.randn(100)
    plan = plan_pt({"a": t16, "b": t32})
    keys = {holder.untyped_storage().data_ptr(): key for key, holder in plan.storages}
    dtypes = {keys[t16.untyped_storage().data_ptr()]: torch.bfloat16, keys[t32.untyped_storage().data_ptr()]: torch.float32}
    sink = _Sink()
    write_pt(plan, sink, dtypes)
    assert set(sink.hints) == {torch.bfloat16, torch.float32}
    assert sink.dtype_hint is None  # reset after each record


def test_zip_is_stored_and_loadable_by_zipfile():
    got, raw, _ = _roundtrip({"w": torch.ones(4)})
    zf = zipfile.ZipFile(io.BytesIO(raw))
    assert zf.testzip() is None
    assert all(i.compress_type == zipfile.ZIP_STORED for i in zf.infolist())
    assert torch.equal(got["w"], torch.ones(4))


# -- the same through the whole save path (snapshot -> serialize -> codec -> storage -> load) --------
@pytest.mark.parametrize("compression", [None, "zstd"])
def test_every_dtype_through_the_manager(tmp_path, compression):
    from checkpointd import CheckpointManager, load

    tensors = {str(dt).replace("torch.", ""): _random(dt, (64, 33)) for dt in DTYPES}
    tensors["empty"] = torch.empty(0, 3)
    tensors["cl"] = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    tensors["big_bf16"] = torch.randn(50_000).to(torch.bfloat16)

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(4, 4, bias=False)
            self.b = torch.nn.Linear(4, 4, bias=False)
            self.b.weight = self.a.weight

    tied = Tied()
    with CheckpointManager(tmp_path, {"tensors": tensors, "tied": tied}, compression=compression) as mgr:
        mgr.save(1)
    got = load(tmp_path)
    for k, v in tensors.items():
        assert _bits_equal(got["tensors"][k], v), k
        assert got["tensors"][k].stride() == v.stride(), k
    assert torch.equal(got["tied"]["a.weight"], tied.a.weight)
    assert got["tied"]["b.weight"].data_ptr() == got["tied"]["a.weight"].data_ptr()


def test_plan_records_each_records_dtype():
    t16 = torch.randn(100).to(torch.bfloat16)
    t32 = torch.randn(100)
    p64 = torch.nn.Parameter(torch.randn(4, dtype=torch.float64))  # not the fast path: a TypedStorage
    plan = plan_pt({"a": t16, "b": [t32, p64], "i": torch.arange(3)})
    keys = {holder.untyped_storage().data_ptr(): key for key, holder in plan.storages}
    want = {keys[t.untyped_storage().data_ptr()]: t.dtype for t in (t16, t32, p64, torch.arange(0))
            if t.untyped_storage().data_ptr() in keys}
    assert {k: plan.dtypes[k] for k in want} == want
    assert set(plan.dtypes.values()) == {torch.bfloat16, torch.float32, torch.float64, torch.int64}


def test_loaded_tensors_get_their_own_hooks_dicts():
    """Like torch.save: each tensor's (empty) backward-hooks dict is its own object after loading."""
    obj = {"a": torch.randn(3), "b": torch.randn(3), "c": [torch.ones(2)]}
    got, raw, _ = _roundtrip(obj)
    ref = io.BytesIO()
    torch.save(obj, ref)
    with zipfile.ZipFile(io.BytesIO(raw)) as ours, zipfile.ZipFile(ref) as theirs:
        mine = next(n for n in ours.namelist() if n.endswith("data.pkl"))
        torchs = next(n for n in theirs.namelist() if n.endswith("data.pkl"))
        assert ours.read(mine) == theirs.read(torchs)  # the same pickle, byte for byte
    hooks = [got["a"]._backward_hooks, got["b"]._backward_hooks, got["c"][0]._backward_hooks]
    assert len({id(h) for h in hooks}) == 3


def _data_pkl(plan) -> bytes:
    sink = _Sink()
    write_pt(plan, sink)
    with zipfile.ZipFile(io.BytesIO(sink.buf.getvalue())) as zf:
        return zf.read(next(n for n in zf.namelist() if n.endswith("data.pkl")))


def test_reduction_cache_reuses_and_pickles_byte_for_byte_like_torch_save():
    """Saves of the same buffers reuse their reductions; the pickle stays torch.save's, hooks dicts apart."""
    tensors = [torch.randn(4, 5), torch.randn(6).to(torch.bfloat16), torch.arange(7), torch.randn(2, 3, 4, 5)]
    tensors[3] = tensors[3].contiguous(memory_format=torch.channels_last)
    obj = {"w": tensors[0], "opt": {"state": {0: {"step": torch.tensor(3.0), "m": tensors[1]}}, "lr": 0.1},
           "ints": tensors[2], "conv": tensors[3], "again": tensors[0]}
    cache = ReductionCache()
    first = plan_pt(obj, cache=cache)
    assert cache.hits == 0 and len(cache) == 5
    second = plan_pt(obj, cache=cache)
    assert cache.hits == 5  # "again" is the same object: the pickle memo has it, no second reduction
    ref = io.BytesIO()
    torch.save(obj, ref)
    with zipfile.ZipFile(ref) as zf:
        torchs = zf.read(next(n for n in zf.namelist() if n.endswith("data.pkl")))
    assert _data_pkl(first) == _data_pkl(second) == torchs
    assert [k for k, _ in first.storages] == [k for k, _ in second.storages] and first.dtypes == second.dtypes
    sink = _Sink()
    write_pt(second, sink)
    got = torch.load(io.BytesIO(sink.buf.getvalue()), weights_only=True)
    assert _bits_equal(got["conv"], tensors[3]) and got["conv"].stride() == tensors[3].stride()
    assert got["again"] is got["w"]
    hooks = [got["w"]._backward_hooks, got["ints"]._backward_hooks, got["conv"]._backward_hooks]
    assert len({id(h) for h in hooks}) == 3


def test_reduction_cache_keeps_record_views_that_the_layout_writes(tmp_path):
    tensors = {"a": torch.randn(1000), "b": torch.arange(300, dtype=torch.int16).reshape(10, 30)}
    cache = ReductionCache()
    plan_pt(tensors, cache=cache)
    plan = plan_pt(tensors, cache=cache)
    assert cache.hits == 2 and set(plan.views) == {k for k, _ in plan.storages}
    for key, holder in plan.storages:
        assert bytes(plan.views[key]) == bytes(storage_view(holder))
    path = str(tmp_path / "cached.pt")
    ptlayout.write_file(path, ziplayout.pt_image(plan), chunk_bytes=1 << 10)
    got = torch.load(path, weights_only=True)
    assert all(torch.equal(got[k], v) for k, v in tensors.items())


def test_reduction_cache_notices_changed_tensors_and_forgets_freed_ones():
    cache = ReductionCache()
    t = torch.randn(10)
    plan_pt({"t": t}, cache=cache)
    t.set_(torch.randn(3, 2).untyped_storage(), 0, (3, 2), (2, 1))  # same object, other storage and shape
    sink = _Sink()
    write_pt(plan_pt({"t": t}, cache=cache), sink)
    assert cache.hits == 0
    got = torch.load(io.BytesIO(sink.buf.getvalue()), weights_only=True)
    assert torch.equal(got["t"], t)
    u = torch.randn(5)
    plan_pt({"u": u}, cache=cache)
    before = len(cache)
    del u
    assert len(cache) == before - 1  # the entry (and the record holder keeping its storage) went with it


def test_reduction_cache_keeps_the_device_rule():
    """A placeholder cached under ``allow_placeholders`` is not served to a plan that does not allow them."""
    cache = ReductionCache()
    placeholder = torch.empty(8, device="meta")
    as_record = plan_pt({"p": placeholder}, allow_placeholders=True, cache=cache)
    assert len(as_record.storages) == 1
    plain = plan_pt({"p": placeholder}, cache=cache)
    assert cache.hits == 0
    assert plain.pickle_bytes == plan_pt({"p": placeholder}).pickle_bytes and plain.storages == []
