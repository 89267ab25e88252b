"""Host staging budget (``StagingOptions.host_budget_bytes``): the chunk ring, on CPU.

Real runs use the ring only for CUDA tensors. Here ``snapshot.STREAM_CPU_TENSORS`` makes CPU tensors go
through it too (plain copies instead of side-stream copies, hooks installed), so these tests exercise
chunking, splitting of big tensors, file order, the hooks' waits (with a slow writer), CRCs, failures,
and that the files are the same as without a budget: byte-identical uncompressed ``.pt``/``.mdlus``,
equal under ``torch.load(weights_only=True)`` with zstd. ``tests/gpu/test_host_budget_cuda.py`` covers CUDA.
"""

from __future__ import annotations

import errno
import hashlib
import io
import logging
import os
import threading
import time
from typing import Any

import fsspec
import pytest
import torch

from checkpointd import options
from checkpointd import CheckpointManager, StagingOptions, CheckpointWriteError, load
from checkpointd.save import chunkring
from checkpointd.save import writer
from checkpointd.storage import persist_process
from checkpointd.storage import sharedmem
from checkpointd.storage import writemode
from checkpointd.save import snapshot
from checkpointd.save.chunkring import ChunkRing, ring_geometry
from checkpointd.save.chunkstream import ChunkStream, plan_chunks
from checkpointd.save.copiers import CpuCopier, byte_view
from checkpointd.errors import ConfigError
from checkpointd.testing.faults import Fault, FaultPlan
from tree_compare import assert_tree_equal
from fake_physicsnemo import FakePNModule
from persist_requests import record_requests

MiB = 1 << 20


@pytest.fixture
def stream_cpu(monkeypatch):
    monkeypatch.setattr(snapshot, "STREAM_CPU_TENSORS", True)


class PNNet(FakePNModule):
    def __init__(self, *, width: int = 256) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(width, 1000)


def _make_state(seed: int = 0) -> dict[str, Any]:
    """~10 MiB across three files: a 4 MiB weight (split over chunks), many small tensors, a
    channels_last conv, BatchNorm buffers, a strided view, empty and bool/int tensors, a .mdlus module."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3), torch.nn.BatchNorm2d(16), torch.nn.Flatten(), torch.nn.Linear(16 * 6 * 6, 1800),
        torch.nn.BatchNorm1d(1800), torch.nn.Linear(1800, 600),
    ).to(memory_format=torch.channels_last)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, 3, 8, 8).to(memory_format=torch.channels_last)).square().mean().backward()
    opt.step()
    base = torch.randn(64, 96)
    extra = {"view": base[:, ::3], "empty": torch.zeros(0, 5), "mask": torch.rand(333) > 0.5,
             "ints": torch.arange(1000, dtype=torch.int64), "n": 3}
    return {"model": model, "opt": opt, "pn": PNNet(width=256), "extra": extra}


def _files(root: str, fs: Any = None) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    if fs is None:
        for dirpath, _, names in os.walk(root):
            for name in names:
                if ".pt" in name or ".mdlus" in name:
                    with open(os.path.join(dirpath, name), "rb") as f:
                        out[os.path.relpath(os.path.join(dirpath, name), root)] = f.read()
    else:
        for path in fs.find(root):
            name = path.rsplit("/", 1)[-1]
            if ".pt" in name or ".mdlus" in name:
                out["step-" + path.split("/step-", 1)[1]] = fs.cat_file(path)
    return out


def _save_once(root: str, budget: int | None, compression: str | None, **kw: Any) -> CheckpointManager:
    state = _make_state()
    mgr = CheckpointManager(root, state, compression=compression, staging=StagingOptions(host_budget_bytes=budget), **kw)
    mgr.save(7)
    mgr.close()
    return mgr


# -- the pieces --------------------------------------------------------------------------------------------


def test_ring_geometry_fits_the_budget_with_a_floor():
    for budget in (2 * MiB, 3 * MiB, 10 * MiB, 100 * MiB, 1250 * 10**6, 80 << 30):
        chunk, n = ring_geometry(budget)
        assert n >= 2 and chunk >= chunkring.MIN_CHUNK_BYTES and chunk <= chunkring.MAX_CHUNK_BYTES
        assert chunk * n <= budget
        assert chunk % 4096 == 0
    assert ring_geometry(1000) == (chunkring.MIN_CHUNK_BYTES, 2)  # raised to the floor (logged by the snapshotter)
    assert ring_geometry(100 * MiB) == (25 * MiB, 4)


def test_plan_chunks_splits_packs_and_puts_buffers_first():
    chunk = 1000
    files = [
        [("0", 0, 2500), ("1", 1, 10), ("2", 2, 10)],  # a record split over three chunks, then small ones
        [("0", 3, 100), ("1", 4, 100)],
    ]
    chunks, early_first = plan_chunks(files, early={2, 3}, chunk_bytes=chunk, n_chunks=8)
    assert early_first
    # early records (sources 2 and 3) first, one file per chunk
    assert [(c.file, [(p.key, p.src) for p in c.parts]) for c in chunks[:2]] == [(0, [("2", 2)]), (1, [("0", 3)])]
    rest = chunks[2:]
    big = [p for c in rest for p in c.parts if p.src == 0]
    assert [(p.start, p.length) for p in big] == [(0, 1000), (1000, 1000), (2000, 500)]
    assert all(len({p.file for p in c.parts}) == 1 for c in chunks)
    for c in chunks:
        for p in c.parts:
            assert p.chunk_offset % chunkring.PART_ALIGN == 0 and p.chunk_offset + p.length <= chunk
    # record order within each file is kept (apart from the early ones)
    order = [(p.file, p.key) for c in rest for p in c.parts]
    assert order == [(0, "0"), (0, "0"), (0, "0"), (0, "1"), (1, "1")]
    # buffers that need more than half the ring are not taken early
    chunks, early_first = plan_chunks(files, early={0}, chunk_bytes=chunk, n_chunks=4)
    assert not early_first and chunks[0].parts[0].src == 0


def test_stream_delivers_exact_bytes_and_is_single_use():
    torch.manual_seed(1)
    base = torch.randn(3, 5)
    sources = [torch.randn(1000), base.t(), torch.randn(4, 6)[:, ::2], torch.arange(7, dtype=torch.int16)]
    expected = [sources[0].numpy().tobytes(), base.numpy().tobytes(),  # dense: its own layout's bytes
                sources[2].contiguous().numpy().tobytes(), sources[3].numpy().tobytes()]  # else contiguous
    ring = ChunkRing(4096, 2, pin=False)
    stream = ChunkStream(ring, CpuCopier(), sources, n_early=0)
    recs = [[(str(i), i, byte_view(t).numel()) for i, t in enumerate(sources)]]
    (reader,) = stream.plan(recs)
    got: dict[str, bytes] = {}

    def consume():
        for i in range(len(sources)):
            got[str(i)] = b"".join(bytes(v) for v in reader.views(str(i)))

    t = threading.Thread(target=consume)
    t.start()
    stream.produce()  # ~4.2 KB through two 4 KiB chunks: the producer waits for the consumer
    t.join()
    stream.close()
    for i in range(len(sources)):
        assert got[str(i)] == expected[i], i
    with pytest.raises(RuntimeError, match="already streamed"):
        list(reader.views("0"))


def test_abort_wakes_producer_consumers_and_hooks():
    ring = ChunkRing(4096, 2, pin=False)
    stream = ChunkStream(ring, CpuCopier(), [torch.randn(4096)], n_early=0)  # 16 KiB: more than the ring
    (reader,) = stream.plan([[("0", 0, 4096 * 4)]])
    producer_error: list[BaseException] = []

    def produce():
        try:
            stream.produce()
        except BaseException as exc:  # noqa: BLE001
            producer_error.append(exc)

    t = threading.Thread(target=produce)
    t.start()
    views = reader.views("0")
    next(views)  # hold the first chunk; the producer fills the second and then blocks
    time.sleep(0.05)
    assert not stream.all_issued.is_set()
    stream.abort(OSError(errno.ENOSPC, "full"))
    t.join(5)
    assert not t.is_alive() and not producer_error  # an abort by someone else is theirs to report
    stream.wait_copied(all_copies=True)  # a hook returns at once
    views.close()
    stream.close()


# -- through the manager: same files as without a budget -----------------------------------------------------


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("where", ["local", "local-stream", "local-mmap", "memory"])
def test_files_match_the_unbudgeted_save(tmp_path, monkeypatch, stream_cpu, compression, where):
    if where == "local-stream":
        monkeypatch.setattr(writer, "parallel_write_applies", lambda *a: False)  # the streaming writer, on local files
    if where == "local-mmap":
        monkeypatch.setattr(writemode, "WRITE_MODE", "mmap")
    if where == "memory":
        base = f"memory://hb-{compression}-{os.getpid()}-{time.monotonic_ns()}"
        ref_root, budget_root = f"{base}/ref", f"{base}/budget"
        fs = fsspec.filesystem("memory")
    else:
        ref_root, budget_root, fs = str(tmp_path / "ref"), str(tmp_path / "budget"), None
    if torch.cuda.is_available():  # the RNG record holds CUDA's state once CUDA is up: up for both saves
        torch.cuda.init()
    monkeypatch.setattr(snapshot, "STREAM_CPU_TENSORS", False)
    _save_once(ref_root, None, compression)
    monkeypatch.setattr(snapshot, "STREAM_CPU_TENSORS", True)
    mgr = _save_once(budget_root, 2 * MiB, compression)  # two 1 MiB chunks; the state is ~10 MiB
    assert mgr.stats()["staging_allocations"] == 1  # the ring only: nothing staged the whole state
    ref, got = _files(ref_root, fs), _files(budget_root, fs)
    assert sorted(ref) == sorted(got) and len(ref) == 3
    if compression is None:
        for name in ref:
            assert hashlib.sha256(ref[name]).digest() == hashlib.sha256(got[name]).digest(), name
    assert_tree_equal(load(ref_root, storage_options=None), load(budget_root))
    for name, data in got.items():
        if name.endswith(".pt"):
            torch.load(io.BytesIO(data), weights_only=True)  # uncompressed files load natively


def test_restore_from_budgeted_save_is_bit_exact(tmp_path, stream_cpu):
    state = _make_state(0)
    with CheckpointManager(tmp_path, state, compression="zstd", staging=StagingOptions(host_budget_bytes=3 * MiB)) as mgr:
        mgr.save(1)
    expected = {k: v.clone() for k, v in state["model"].state_dict().items()}
    fresh = _make_state(5)
    with CheckpointManager(tmp_path, fresh, compression="zstd", staging=StagingOptions(host_budget_bytes=3 * MiB)) as mgr:
        assert mgr.restore_latest() == 1
    for k, v in fresh["model"].state_dict().items():
        assert torch.equal(v, expected[k]) and v.stride() == expected[k].stride(), k


# -- consistency: the hooks wait until the bytes left the "device" --------------------------------------------


def _slow_root(tmp_path, delay: float):
    plan = FaultPlan(Fault(op="write", error=None, delay_secs=delay, path="*step-*"))
    return f"faulty://{tmp_path}/ckpt", {"target_protocol": "file", "faults": plan}


def test_optimizer_step_waits_until_everything_is_copied(tmp_path, stream_cpu):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.BatchNorm1d(1024), torch.nn.Linear(1024, 1024))
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)

    def step():
        model(torch.randn(8, 1024)).square().mean().backward()
        opt.step()
        opt.zero_grad()

    step()
    root, so = _slow_root(tmp_path, 0.02)  # each write call of the streaming writer takes 20 ms
    mgr = CheckpointManager(root, {"model": model, "opt": opt}, compression=None, storage_options=so,
                            staging=StagingOptions(host_budget_bytes=2 * MiB))
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    expected_opt = {k: {n: v.clone() for n, v in st.items()} for k, st in opt.state_dict()["state"].items()}
    assert mgr.maybe_save(3, force=True)
    stream = mgr._snap._inflight[-1]
    assert isinstance(stream, ChunkStream)
    t0 = time.perf_counter()
    model(torch.randn(8, 1024) + 3)  # forward: waits only for the BatchNorm buffers (copied first)
    t_forward = time.perf_counter() - t0
    assert stream.buffers_issued.is_set()
    assert not stream.all_issued.is_set(), "with a slow writer the parameters cannot all be copied yet"
    opt.zero_grad()
    t0 = time.perf_counter()
    step()  # the optimizer step's pre-hook blocks until every tensor left for the ring
    t_step = time.perf_counter() - t0
    assert stream.all_issued.is_set()
    assert t_step > 0.1 and t_step > t_forward
    assert mgr.stats()["staging_hook_wait_secs"] >= 0.1
    mgr.wait()
    saved = load(f"{tmp_path}/ckpt", step=3)
    assert_tree_equal(saved["model"], expected)
    assert_tree_equal(saved["opt"]["state"], expected_opt)
    assert not torch.equal(model[0].weight, expected["0.weight"])  # training did go on
    mgr.close()


def test_consecutive_saves_reuse_the_ring_and_hold_their_own_values(tmp_path, stream_cpu):
    torch.manual_seed(0)
    model = torch.nn.Linear(700, 900)
    opt = torch.optim.Adam(model.parameters())
    mgr = CheckpointManager(tmp_path, {"model": model, "opt": opt}, compression=None, max_pending=2, keep_last=None,
                            staging=StagingOptions(host_budget_bytes=2 * MiB))
    snaps = {}
    allocations = None
    for step in range(1, 6):
        model(torch.randn(3, 700)).sum().backward()
        opt.step()
        opt.zero_grad()
        snaps[step] = {k: v.clone() for k, v in model.state_dict().items()}
        mgr.save(step)
        if step == 1:
            mgr.wait()
            allocations = mgr.stats()["staging_allocations"]
            ring = mgr._snap.ring
    mgr.wait()
    assert mgr.stats()["staging_allocations"] == allocations and mgr._snap.ring is ring
    for step, values in snaps.items():
        assert_tree_equal(load(tmp_path, step=step)["model"], values)
    mgr.close()


def test_write_failure_fails_the_save_without_hanging_training(tmp_path, stream_cpu):
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 2048)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plan = FaultPlan(Fault(op="write", path="*step-000000001*", nth=3, error=lambda op, path: OSError(errno.ENOSPC, "full")))
    mgr = CheckpointManager(f"faulty://{tmp_path}/ckpt", {"model": model, "opt": opt}, compression="zstd",
                            storage_options={"target_protocol": "file", "faults": plan}, staging=StagingOptions(host_budget_bytes=2 * MiB))
    mgr.save(1)
    model(torch.randn(2, 1024)).sum().backward()
    done = threading.Event()
    threading.Thread(target=lambda: (opt.step(), done.set()), daemon=True).start()
    assert done.wait(30), "the optimizer hook must not hang when the save fails"
    with pytest.raises(CheckpointWriteError) as info:
        mgr.wait()
    assert "No space" in str(info.value) or "full" in str(info.value)
    assert mgr.steps() == []
    mgr.save(2)  # the ring was reset: the next save works
    mgr.wait()
    assert mgr.steps() == [2]
    assert_tree_equal(load(f"{tmp_path}/ckpt")["model"], {k: v for k, v in model.state_dict().items()})
    mgr.close()


# -- who writes the chunks: the persist process, else this process ----------------------------------------------

needs_persist_process = pytest.mark.skipif(not sharedmem.supported(), reason="the persist process needs Linux memfd_create")


@needs_persist_process
def test_the_persist_process_writes_the_chunks(tmp_path, monkeypatch, stream_cpu):
    """The ring lives in shared memory and each chunk is one ``put`` request of ranges of one ring slot;
    the files are byte-identical to those this process writes when the persist process is off."""
    def save(root: str) -> tuple[Any, int]:
        with CheckpointManager(root, _make_state(), compression=None, staging=StagingOptions(host_budget_bytes=2 * MiB)) as mgr:
            mgr.save(7)
            mgr.wait()
            return mgr._snap.ring.slots, mgr._snap.ring.chunk_bytes

    monkeypatch.setenv(options.PERSIST_PROCESS_ENV, "0")
    slots, _ = save(str(tmp_path / "here"))
    assert slots is None  # private memory: the chunks are written from this process
    monkeypatch.delenv(options.PERSIST_PROCESS_ENV)
    puts = record_requests(monkeypatch, "put")
    before = persist_process.client().writes_done
    slots, chunk_bytes = save(str(tmp_path / "there"))
    assert slots is not None and len({slab.id for slab, _ in slots}) == 1
    slab, base = slots[0]
    ranges = [r for m in puts for task in m[4] for r in task]
    state_bytes = sum(t.numel() * t.element_size() for t in _make_state()["model"].state_dict().values())
    assert sum(n for *_, n in ranges) >= state_bytes
    for m in puts:  # one request, one chunk: its ranges lie in one slot of the ring
        used = {(start - base) // chunk_bytes for task in m[4] for _, _, start, _ in task}
        assert len(used) == 1 and all(sid == slab.id for task in m[4] for _, sid, _, _ in task)
    assert persist_process.client().writes_done >= before + len(puts)
    ref, got = _files(str(tmp_path / "here")), _files(str(tmp_path / "there"))
    assert sorted(ref) == sorted(got) and len(ref) == 3
    for name in ref:
        assert ref[name] == got[name], name


@needs_persist_process
@pytest.mark.parametrize("how", ["refused", "lost"])
def test_chunks_the_persist_process_cannot_take_are_written_here(tmp_path, monkeypatch, stream_cpu, caplog, how):
    """``refused``: the request cannot be sent (the process is gone); ``lost``: it was sent and the process
    went away before answering. Either way that chunk and the rest are written by this process."""
    monkeypatch.setattr(snapshot, "STREAM_CPU_TENSORS", False)
    _save_once(str(tmp_path / "ref"), None, None)
    monkeypatch.setattr(snapshot, "STREAM_CPU_TENSORS", True)
    real_submit = persist_process.RemoteFile.submit
    calls = {"n": 0}

    def flaky(self, tasks):
        calls["n"] += 1
        if calls["n"] % 2:
            return real_submit(self, tasks)
        if how == "refused":
            raise persist_process.PersistProcessError("the persist process has exited")
        future = persist_process.Future()
        threading.Timer(0.05, future.set_exception, [persist_process.PersistProcessError("gone")]).start()
        return future

    monkeypatch.setattr(persist_process.RemoteFile, "submit", flaky)
    with caplog.at_level(logging.WARNING, logger="checkpointd"):
        _save_once(str(tmp_path / "budget"), 2 * MiB, None)
    assert calls["n"] >= 2 and "writing the host staging chunks from this process" in caplog.text
    ref, got = _files(str(tmp_path / "ref")), _files(str(tmp_path / "budget"))
    assert sorted(ref) == sorted(got)
    for name in ref:
        assert ref[name] == got[name], name


@needs_persist_process
def test_a_chunk_the_persist_process_fails_to_write_fails_the_save(tmp_path, monkeypatch, stream_cpu):
    """A write error in the process (a full disk) fails that save, without hanging training; the next works."""
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 2048)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    real_submit = persist_process.RemoteFile.submit
    calls = {"n": 0}

    def full_once(self, tasks):
        calls["n"] += 1
        if calls["n"] != 2:
            return real_submit(self, tasks)
        future = persist_process.Future()
        future.set_exception(OSError(errno.ENOSPC, "persist process: No space left on device"))
        return future

    monkeypatch.setattr(persist_process.RemoteFile, "submit", full_once)
    mgr = CheckpointManager(tmp_path, {"model": model, "opt": opt}, compression=None, staging=StagingOptions(host_budget_bytes=2 * MiB))
    mgr.save(1)
    model(torch.randn(2, 1024)).sum().backward()
    done = threading.Event()
    threading.Thread(target=lambda: (opt.step(), done.set()), daemon=True).start()
    assert done.wait(30), "the optimizer hook must not hang when the save fails"
    with pytest.raises(CheckpointWriteError, match="No space"):
        mgr.wait()
    assert mgr.steps() == [] and calls["n"] >= 2
    mgr.save(2)
    mgr.wait()
    assert mgr.steps() == [2]
    assert_tree_equal(load(tmp_path)["model"], {k: v for k, v in model.state_dict().items()})
    mgr.close()


# -- configuration ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -5, 1.5, True, "1000"])
def test_budget_must_be_a_positive_int(tmp_path, bad):
    with pytest.raises(ConfigError, match="StagingOptions.host_budget_bytes"):
        CheckpointManager(tmp_path, {"t": torch.zeros(3)}, staging=StagingOptions(host_budget_bytes=bad))


def test_full_mode_distributed_is_rejected(tmp_path, monkeypatch):
    import checkpointd.distributed as dist

    monkeypatch.setattr(dist, "is_active", lambda: True)
    with pytest.raises(ConfigError, match="mode='sharded'"):
        CheckpointManager(tmp_path, {"t": torch.zeros(3)}, staging=StagingOptions(host_budget_bytes=MiB), mode="full")


def test_cpu_only_run_ignores_the_budget_with_a_note(tmp_path, caplog):
    if torch.cuda.is_available():
        pytest.skip("CPU-only behaviour")
    state = {"t": torch.arange(10.0)}
    with caplog.at_level(logging.INFO, logger="checkpointd"):
        mgr = CheckpointManager(tmp_path, state, compression=None, staging=StagingOptions(host_budget_bytes=MiB))
    assert "ignored without CUDA" in caplog.text
    mgr.save(1)
    state["t"].add_(1)  # CPU: anything may change right after maybe_save
    mgr.close()
    assert torch.equal(load(tmp_path)["t"], torch.arange(10.0))


def test_tiny_budget_uses_the_floor(tmp_path, stream_cpu, caplog):
    torch.manual_seed(0)
    state = {"w": torch.randn(3 * MiB // 4)}
    expected = state["w"].clone()
    with caplog.at_level(logging.WARNING, logger="checkpointd"):
        with CheckpointManager(tmp_path, state, compression=None, staging=StagingOptions(host_budget_bytes=4096)) as mgr:
            mgr.save(1)
            mgr.wait()
            assert mgr._snap.ring.nbytes == 2 * chunkring.MIN_CHUNK_BYTES
    assert "below the floor" in caplog.text
    assert torch.equal(load(tmp_path)["w"], expected)
