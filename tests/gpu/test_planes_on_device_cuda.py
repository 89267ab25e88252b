"""``zstd-planes`` restores decoded on the GPU (``codecs.planes_device``): bit-exact, in place, and damage caught.

The checkpoint is mapped (``fastload.use_mmap`` as on tmpfs); its files are uploaded, checksummed and
decoded on the device, and the live CUDA tensors are filled from there. Skipped where CUDA is unavailable.
"""

from __future__ import annotations

import copy
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from checkpointd import CheckpointManager
from checkpointd.codecs.compress import decode_bytes
from checkpointd.codecs.planes_device import decode_on_device
from checkpointd.errors import CorruptCheckpointError
from checkpointd.restore import device_decode, device_image, fastload
from checkpointd.restore import step as restore_step

from planes_files import planes_file
from test_restore_cuda import _assert_same, _model, _scramble

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture
def on_device(monkeypatch):
    monkeypatch.setattr(fastload, "use_mmap", lambda path, size: size > 0)
    monkeypatch.setenv("CHECKPOINTD_RESTORE_VERIFY", "device")
    monkeypatch.setattr(device_image, "MIN_BYTES", 1)


def _trained_mixed(seed: int = 0):
    """``_trained``'s model with a bf16 weight and an fp64 bias (2- and 8-byte planes), and their AdamW state."""
    torch.manual_seed(seed)
    model = _model()
    with torch.no_grad():
        model[4].weight.data = model[4].weight.data.to(torch.bfloat16)
        model[3].bias.data = model[3].bias.data.double()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):  # (no forward: the layers' dtypes differ)
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
        opt.zero_grad()
    return model, opt


@pytest.fixture
def saved(tmp_path):
    model, opt = _trained_mixed()
    with CheckpointManager(str(tmp_path), {"model": model, "optim": opt}, compression="zstd-planes") as mgr:
        mgr.save(1)
        mgr.wait()
    return tmp_path, copy.deepcopy((model, opt))


def _fresh_like(ref_model):
    model, opt = _trained_mixed(1)
    _scramble(model, opt)
    return model, opt


def test_a_planes_restore_is_decoded_on_the_device_exactly_and_in_place(saved, on_device) -> None:
    root, (ref_model, ref_opt) = saved
    model, opt = _fresh_like(ref_model)
    held = {id(p): dict(opt.state[p]) for p in model.parameters()}
    before = dict(device_image.stats)
    with CheckpointManager(str(root), {"model": model, "optim": opt}, compression="zstd-planes") as mgr:
        assert mgr.restore_latest() == 1
    torch.cuda.synchronize()
    got = {k: device_image.stats[k] - before[k] for k in before}
    assert got["decoded"] >= 1 and got["failed"] == 0 and got["copies"] > 10
    assert got["host_filled_bytes"] == 0, "the host read bytes that only the device had decoded"
    _assert_same(ref_model, ref_opt, model, opt)
    for p in model.parameters():
        for key, t in held[id(p)].items():  # (torch keeps a CPU step as stored: only the moments are in place)
            assert key == "step" or opt.state[p][key] is t, f"{key} was replaced, not written in place"


def test_the_device_decodes_on_a_stream_of_its_own_before_the_checksum_is_read(saved, on_device, monkeypatch) -> None:
    root, (ref_model, ref_opt) = saved
    model, opt = _fresh_like(ref_model)
    streams, real_decode, real_check = [], device_decode.decode_on_device, restore_step.check_file
    order = []

    def spied_decode(*args, **kwargs):
        streams.append(kwargs.get("stream"))
        order.append("decode")
        return real_decode(*args, **kwargs)

    def spied_check(*args):
        order.append("checksum")
        return real_check(*args)

    monkeypatch.setattr(device_decode, "decode_on_device", spied_decode)
    monkeypatch.setattr(restore_step, "check_file", spied_check)
    before = dict(device_image.stats)
    with CheckpointManager(str(root), {"model": model, "optim": opt}, compression="zstd-planes") as mgr:
        assert mgr.restore_latest() == 1
    got = {k: device_image.stats[k] - before[k] for k in before}
    assert got["decoded"] == len(streams) >= 1 and got["failed"] == 0
    assert all(s is not None and s != torch.cuda.default_stream() for s in streams)  # the readback does not wait for it
    assert order.index("decode") < order.index("checksum")
    _assert_same(ref_model, ref_opt, model, opt)


def test_a_fresh_optimizer_restores_from_a_device_decoded_file(saved, on_device) -> None:
    root, (ref_model, ref_opt) = saved
    model, _ = _fresh_like(ref_model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = device_image.stats["decoded"]
    with CheckpointManager(str(root), {"model": model, "optim": opt}, compression="zstd-planes") as mgr:
        assert mgr.restore_latest() == 1
    assert device_image.stats["decoded"] > before
    _assert_same(ref_model, ref_opt, model, opt)


def test_a_damaged_planes_file_is_refused_on_the_device_path_and_nothing_changes(saved, on_device) -> None:
    root, (ref_model, _) = saved
    step = next(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step"))
    victim = max((f for f in step.iterdir() if f.is_file()), key=lambda f: f.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 3] ^= 0x04
    victim.write_bytes(bytes(data))
    model, opt = _fresh_like(ref_model)
    live = [t.clone() for t in model.state_dict().values()]
    with CheckpointManager(str(root), {"model": model, "optim": opt}, compression="zstd-planes") as mgr:
        with pytest.raises(CorruptCheckpointError):
            mgr.restore(1)
    for a, b in zip(live, model.state_dict().values()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("queued", [True, False])
@pytest.mark.parametrize("merge_kernel", [True, False])
def test_the_cuda_decoder_equals_the_host_decoder(dtype, queued, merge_kernel, monkeypatch) -> None:
    """The host-decoded bytes go up in one queued copy, or (more than ``QUEUED_UPLOAD_BYTES``) through
    ``upload``; the planes are merged and the uploaded chunks put in place by the merge kernel, or (where
    it does not build) by torch operations."""
    from checkpointd.codecs import merge_device, planes_device

    if not queued:
        monkeypatch.setattr(planes_device, "QUEUED_UPLOAD_BYTES", 0)
    if not merge_kernel:
        monkeypatch.setattr(merge_device, "available", lambda device: False)
    native, stored = planes_file(dtype, 3_000_001)
    on_gpu = torch.frombuffer(bytearray(stored), dtype=torch.uint8).cuda()
    with ThreadPoolExecutor(4) as pool:
        out = decode_on_device(memoryview(stored), on_gpu, pool)
    assert out.data.device.type == "cuda"
    assert bytes(decode_bytes("zstd-planes", stored)) == native
    assert torch.equal(out.data.cpu(), torch.frombuffer(bytearray(native), dtype=torch.uint8))


def test_a_decoding_on_a_stream_of_its_own_gives_its_buffers_back_to_the_current_stream() -> None:
    """A restore decodes on a side stream; the large buffers must go back to the pool the training
    allocates from (the current stream's), not sit cached for a stream nothing else allocates on."""
    native, stored = planes_file(torch.float32, 8_000_003)  # 32 MB: 8 MB of exponent plane decoded on the device
    on_gpu = torch.frombuffer(bytearray(stored), dtype=torch.uint8).cuda()
    side = torch.cuda.Stream()
    with ThreadPoolExecutor(4) as pool:
        out = decode_on_device(memoryview(stored), on_gpu, pool, wait=False, stream=side)
    out.check()
    assert torch.equal(out.data.cpu(), torch.frombuffer(bytearray(native), dtype=torch.uint8))
    del out
    torch.cuda.synchronize()
    on_side = sum(seg["total_size"] for seg in torch.cuda.memory_snapshot() if seg["stream"] == side.cuda_stream)
    assert on_side < 4 << 20, f"{on_side} bytes cached for the decode stream"


@pytest.mark.parametrize("legacy", [False, True])
def test_the_cuda_decoder_equals_the_host_decoder_on_huffman_and_earlier_planes(legacy) -> None:
    native, stored = planes_file(torch.float32, 1_000_003, legacy=legacy)
    on_gpu = torch.frombuffer(bytearray(stored), dtype=torch.uint8).cuda()
    with ThreadPoolExecutor(4) as pool:
        out = decode_on_device(memoryview(stored), on_gpu, pool)
    assert torch.equal(out.data.cpu(), torch.frombuffer(bytearray(native), dtype=torch.uint8))


def _both_decode(stored: bytes, plane, count: int, per_plane=None):
    """``huffman_device.decode`` of one plane of ``stored`` on the GPU and on the CPU (the host decoder on
    :func:`block_rows`): ``((bad, symbols) on the GPU, (bad, symbols) on the CPU)``."""
    import numpy as np

    from checkpointd.codecs import huffman, huffman_device

    at = huffman.PlaneAt(0, plane, 0, count)
    tables = huffman_device.plane_tables([at])
    if per_plane is not None:
        tables = (per_plane, tables[1])
    out = []
    for device in (torch.device("cuda", torch.cuda.current_device()), torch.device("cpu")):
        src = torch.frombuffer(bytearray(stored), dtype=torch.uint8).to(device)
        dst = torch.zeros(count, dtype=torch.uint8, device=device)
        bad = torch.zeros((), dtype=torch.bool, device=device)
        huffman_device.decode(src, dst, [at], bad, tables)
        out.append((bool(bad.item()), dst.cpu().numpy()))
    assert isinstance(out[0][1], np.ndarray)
    return out


def test_the_huffman_kernel_and_the_host_decoder_agree_on_every_block_good_or_forged() -> None:
    """The CUDA kernel (which reads each block's ends from the stored bytes itself) and the C decoder on
    the host's rows give the same symbols, and refuse the same stored bytes with a block end moved
    either way, past the stream or to zero."""
    import numpy as np

    from checkpointd.codecs import huffman, huffman_device

    assert huffman_device.available(torch.device("cuda"))
    rng = np.random.default_rng(0)
    symbols = (rng.geometric(0.35, 50_001).clip(1, 40) + 100).astype(np.uint8)
    stored = b"".join(bytes(memoryview(p).cast("B")) for p in huffman.encode(symbols))
    plane = huffman.read_plane(stored, symbols.size)
    assert plane.ends.size > 8
    (gpu_bad, gpu), (cpu_bad, cpu) = _both_decode(stored, plane, symbols.size)
    assert not gpu_bad and not cpu_bad and np.array_equal(gpu, symbols) and np.array_equal(cpu, symbols)
    ends_at = huffman.HEADER.size + huffman.LENGTHS_NBYTES
    for k, end in [(3, int(plane.ends[3]) + 1), (5, int(plane.ends[5]) - 1), (0, 0xFFFFFFFF), (6, 0)]:
        forged = bytearray(stored)
        forged[ends_at + 4 * k : ends_at + 4 * k + 4] = end.to_bytes(4, "little")
        (gpu_bad, _), (cpu_bad, _) = _both_decode(bytes(forged), plane, symbols.size)
        assert gpu_bad and cpu_bad, f"block {k}'s end moved to {end} went through"


def test_the_huffman_kernel_reads_no_block_end_outside_the_stored_bytes() -> None:
    """A plane row whose block ends would lie past the stored bytes sets the damage flag."""
    import numpy as np

    from checkpointd.codecs import huffman, huffman_device

    symbols = (np.random.default_rng(1).geometric(0.35, 10_000).clip(1, 40) + 100).astype(np.uint8)
    stored = b"".join(bytes(memoryview(p).cast("B")) for p in huffman.encode(symbols))
    at = huffman.PlaneAt(0, huffman.read_plane(stored, symbols.size), 0, symbols.size)
    per_plane, table = huffman_device.plane_tables([at])
    per_plane[0, 0] = len(stored) - 2  # where its block ends are: the last two bytes
    device = torch.device("cuda", torch.cuda.current_device())
    bad = torch.zeros((), dtype=torch.bool, device=device)
    huffman_device.decode(torch.frombuffer(bytearray(stored), dtype=torch.uint8).to(device),
                          torch.zeros(symbols.size, dtype=torch.uint8, device=device), [at], bad, (per_plane, table))
    assert bool(bad.item())


def test_the_merge_kernel_equals_the_host_merge_for_every_element_size_and_alignment() -> None:
    """Chunks of 2-, 4- and 8-byte elements, rotated or not, shorter and longer than a tile, written at
    aligned and unaligned offsets of one output, in one launch: the bytes of ``plane_kernels.from_planes``."""
    import numpy as np

    from checkpointd.codecs import merge_device, plane_kernels

    device = torch.device("cuda", torch.cuda.current_device())
    assert merge_device.available(device)
    rng = np.random.default_rng(1)
    specs = [(4, True, 100_003, 0), (2, True, 5, 1), (8, False, 70_001, 3), (4, False, merge_device.TILE, 2),
             (8, True, 3 * merge_device.TILE + 7, 0), (2, False, 40_000, 0)]
    out = torch.zeros(sum(s * n + a for s, _, n, a in specs) + 8, dtype=torch.uint8, device=device)
    expected = np.zeros(out.numel(), dtype=np.uint8)
    sources = [torch.zeros(8, dtype=torch.uint8, device=device), torch.zeros(8, dtype=torch.uint8, device=device)]
    chunks, at = [], 0
    for size, rotated, count, skew in specs:
        at += skew
        planes = rng.integers(0, 256, (size, count), dtype=np.uint8)
        plane_kernels.from_planes(list(planes), expected[at : at + size * count], rotated)
        where = []
        for j, p in enumerate(planes):  # each plane at some offset of one of two sources
            k, off = j % 2, sources[j % 2].numel() + 3
            sources[k] = torch.cat([sources[k], torch.zeros(3, dtype=torch.uint8, device=device),
                                    torch.from_numpy(p.copy()).to(device)])
            where.append((k, off))
        chunks.append(merge_device.Chunk(at, count, where, rotated))
        at += size * count
    merge_device.merge(out, sources, chunks)
    assert np.array_equal(out.cpu().numpy(), expected)
    with pytest.raises(ValueError, match="merge"):  # a plane reaching past its source
        merge_device.merge(out, sources, [merge_device.Chunk(0, 10, [(0, sources[0].numel() - 9), (1, 0)], False)])
    with pytest.raises(ValueError, match="merge"):  # elements reaching past the output
        merge_device.merge(out, sources, [merge_device.Chunk(out.numel() - 19, 10, [(0, 0), (1, 0)], False)])


def test_the_merge_kernel_copies_one_plane_chunks_byte_for_byte() -> None:
    """A chunk of one plane is a copy (how a restore scatters the bytes it uploaded together), at any
    offset, longer and shorter than a tile, in the same launch as merged chunks."""
    from checkpointd.codecs import merge_device

    device = torch.device("cuda", torch.cuda.current_device())
    source = torch.randint(0, 256, (3 * merge_device.TILE + 11,), dtype=torch.uint8, device=device)
    planes = torch.randint(0, 256, (2, 1000), dtype=torch.uint8, device=device)
    out = torch.zeros(4 * merge_device.TILE, dtype=torch.uint8, device=device)
    merge_device.merge(out, [source, planes.reshape(-1)], [
        merge_device.Chunk(1, 2 * merge_device.TILE + 5, [(0, 3)], False),
        merge_device.Chunk(2 * merge_device.TILE + 9, 7, [(0, 0)], False),
        merge_device.Chunk(3 * merge_device.TILE, 1000, [(1, 0), (1, 1000)], False)])
    expected = torch.zeros_like(out)
    expected[1 : 2 * merge_device.TILE + 6] = source[3 : 2 * merge_device.TILE + 8]
    expected[2 * merge_device.TILE + 9 : 2 * merge_device.TILE + 16] = source[:7]
    expected[3 * merge_device.TILE : 3 * merge_device.TILE + 2000] = planes.t().reshape(-1)
    assert torch.equal(out, expected)


def test_a_cuda_planes_restore_merges_with_the_kernel(monkeypatch) -> None:
    """Files without nibble planes never take the torch merge on CUDA; earlier files' nibble planes do."""
    from checkpointd.codecs import planes_device

    calls = []
    real = planes_device._merge
    monkeypatch.setattr(planes_device, "_merge", lambda *a: calls.append(1) or real(*a))
    for legacy in (False, True):
        native, stored = planes_file(torch.float32, 300_007, legacy=legacy)
        on_gpu = torch.frombuffer(bytearray(stored), dtype=torch.uint8).cuda()
        with ThreadPoolExecutor(2) as pool:
            out = decode_on_device(memoryview(stored), on_gpu, pool)
        assert torch.equal(out.data.cpu(), torch.frombuffer(bytearray(native), dtype=torch.uint8))
        assert bool(calls) == legacy
