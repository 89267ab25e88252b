"""Session 29 probe: CRC-32 of a file's bytes computed on the GPU, and what a restore that verifies there would cost.

Today a restore checksums each mapped file on the CPU (page population ~23 ms + CRC ~47 ms for 4.83 GB,
H200), then bounces it to the GPU (~90 ms). Verifying on the GPU instead: bounce the file into a device
image, compute its CRC-32 there, fill the live tensors from the image once it matched. This probe
measures the pieces on one file (no library change):

- ``populate`` / ``cpu crc``: today's verified read, apart (16 threads, 32 MiB ranges);
- ``upload (populated)``: the bounce of the whole mapped file into a GPU buffer (``bulkcopy._bounced_h2d``);
- ``upload (fresh mapping)``: the same from a mapping never populated (the copy's threads fault the pages);
- ``gpu crc``: CRC-32 of the device image: the file in 4 KiB lanes (a Triton kernel, slice-by-4 tables,
  one lane per thread; torch ops where Triton is missing), lane CRCs combined in a tree on the GPU
  (zero lanes prepended to a power of two: leading zero bytes leave a zero-initialised CRC unchanged),
  the tail past the last whole lane on the CPU; checked against zlib-ng's CRC of the same bytes;
- ``d2d``: copying the image into as many bytes of other GPU memory (the live tensors' fill).

Run: python benchmarks/results/probe/s29/gpu_crc_probe.py [GB] [--json out.json]; PROBE_CPU=1: a CPU self-test
of the arithmetic (torch-ops lanes) against zlib on assorted sizes.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import sys
import time
import zlib

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "..", "src"))

LANE_BYTES = 4096
_POLY = 0xEDB88320


def _tables() -> np.ndarray:
    """Slice-by-4 tables (reflected CRC-32): t[0] the byte table, t[k][b] = (t[k-1][b] >> 8) ^ t[0][t[k-1][b] & 255]."""
    t = np.zeros((4, 256), dtype=np.uint32)
    for b in range(256):
        c = b
        for _ in range(8):
            c = (c >> 1) ^ _POLY if c & 1 else c >> 1
        t[0, b] = c
    for k in range(1, 4):
        t[k] = (t[k - 1] >> 8) ^ t[0][t[k - 1] & 255]
    return t


TABLES = _tables()


def _apply(basis: np.ndarray, v: np.ndarray) -> np.ndarray:
    """A GF(2)-linear map on uint32 given by the images of the 32 unit vectors, applied to ``v``."""
    out = np.zeros_like(v)
    for j in range(32):
        out ^= np.where((v >> np.uint32(j)) & np.uint32(1), basis[j], np.uint32(0))
    return out


def _zero_bytes_basis(nbytes: int) -> np.ndarray:
    """Images of the unit vectors under "feed nbytes zero bytes" (raw CRC state update)."""
    unit = (np.uint32(1) << np.arange(32, dtype=np.uint32)).astype(np.uint32)
    one = unit.copy()
    for _ in range(8):  # one zero byte = 8 zero bits
        one = np.where(one & np.uint32(1), (one >> np.uint32(1)) ^ np.uint32(_POLY), one >> np.uint32(1)).astype(np.uint32)
    # square-and-multiply over nbytes
    result = unit.copy()  # identity
    power = one
    n = nbytes
    while n:
        if n & 1:
            result = _apply(power, result)
        power = _apply(power, power)
        n >>= 1
    return result


def _byte_tables(basis: np.ndarray) -> np.ndarray:
    """4 x 256 tables: map(c) = t[0][c & 255] ^ t[1][(c >> 8) & 255] ^ t[2][(c >> 16) & 255] ^ t[3][c >> 24]."""
    t = np.zeros((4, 256), dtype=np.uint32)
    for k in range(4):
        for j in range(8):
            t[k, 1 << j: 2 << j] = t[k, : 1 << j] ^ basis[8 * k + j]
    return t


@functools.lru_cache(maxsize=None)
def _combine_tables(levels: int, device: str) -> torch.Tensor:
    """[levels, 4, 256] int64: level k shifts a lane-group CRC past LANE_BYTES * 2**k zero bytes."""
    basis = _zero_bytes_basis(LANE_BYTES)
    out = []
    for _ in range(levels):
        out.append(_byte_tables(basis))
        basis = _apply(basis, basis)
    return torch.from_numpy(np.stack(out).astype(np.int64)).to(device)


def _lanes_torch(words: torch.Tensor) -> torch.Tensor:
    """Raw (zero-initialised) CRC of each row of ``words`` ([lanes, LANE_BYTES // 4] int32), torch ops."""
    t = torch.from_numpy(TABLES.astype(np.int64)).to(words.device)
    c = torch.zeros(words.shape[0], dtype=torch.int64, device=words.device)
    for k in range(words.shape[1]):
        x = c ^ (words[:, k].to(torch.int64) & 0xFFFFFFFF)
        c = t[3][x & 255] ^ t[2][(x >> 8) & 255] ^ t[1][(x >> 16) & 255] ^ t[0][(x >> 24) & 255]
    return c


_triton_kernel = None


def _lanes_triton(words: torch.Tensor) -> torch.Tensor:
    global _triton_kernel
    import triton
    import triton.language as tl

    if _triton_kernel is None:
        @triton.jit
        def crc_lanes(data, out, tab, n_lanes, WORDS: tl.constexpr, BLOCK: tl.constexpr):
            lanes = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            mask = lanes < n_lanes
            base = lanes.to(tl.int64) * WORDS
            c = tl.zeros([BLOCK], dtype=tl.uint32)
            for k in range(WORDS):
                w = tl.load(data + base + k, mask=mask, other=0).to(tl.uint32, bitcast=True)
                x = c ^ w
                i0 = (x & 255).to(tl.int32)
                i1 = ((x >> 8) & 255).to(tl.int32)
                i2 = ((x >> 16) & 255).to(tl.int32)
                i3 = (x >> 24).to(tl.int32)
                c = (tl.load(tab + 768 + i0).to(tl.uint32, bitcast=True) ^ tl.load(tab + 512 + i1).to(tl.uint32, bitcast=True)
                     ^ tl.load(tab + 256 + i2).to(tl.uint32, bitcast=True) ^ tl.load(tab + i3).to(tl.uint32, bitcast=True))
            tl.store(out + lanes, c.to(tl.int32, bitcast=True), mask=mask)
        _triton_kernel = crc_lanes
    tab = torch.from_numpy(TABLES.view(np.int32).reshape(-1).copy()).to(words.device)
    n = words.shape[0]
    out = torch.empty(n, dtype=torch.int32, device=words.device)
    block = int(os.environ.get("PROBE_BLOCK", "128"))
    _triton_kernel[(triton.cdiv(n, block),)](words, out, tab, n, WORDS=words.shape[1], BLOCK=block)
    return out.to(torch.int64) & 0xFFFFFFFF


def crc32_device(buf: torch.Tensor, host_tail: bytes | memoryview | None = None, use_triton: bool = True) -> int:
    """zlib's CRC-32 of the bytes of ``buf`` (1-D uint8, any device); ``host_tail``: the same bytes past
    the last whole lane, read on the host (else copied from ``buf``)."""
    from checkpointd.crc import crc32, crc32_combine, crc32_combine_py

    n = buf.numel()
    lanes = n // LANE_BYTES
    body = lanes * LANE_BYTES
    raw = 0
    if lanes:
        words = buf[:body].view(torch.int32).view(lanes, LANE_BYTES // 4)
        c = _lanes_triton(words) if use_triton else _lanes_torch(words)
        levels = max(0, (lanes - 1).bit_length())
        if (1 << levels) != lanes:  # leading zero lanes: a zero-initialised CRC ignores leading zero bytes
            c = torch.cat([torch.zeros((1 << levels) - lanes, dtype=torch.int64, device=c.device), c])
        tabs = _combine_tables(levels, str(c.device)) if levels else None
        for k in range(levels):
            pair = c.view(-1, 2)
            a, b = pair[:, 0], pair[:, 1]
            t = tabs[k]
            c = t[0][a & 255] ^ t[1][(a >> 8) & 255] ^ t[2][(a >> 16) & 255] ^ t[3][(a >> 24) & 255] ^ b
        raw = int(c.item())
        # zlib's conditioning: crc32(M) = raw(M) ^ shift_len(M)(0xFFFFFFFF) ^ 0xFFFFFFFF
        crc = raw ^ crc32_combine_py(0xFFFFFFFF, 0, body) ^ 0xFFFFFFFF
    else:
        crc = 0
    tail = host_tail if host_tail is not None else bytes(buf[body:].cpu().numpy())
    if len(tail):
        crc = crc32_combine(crc, crc32(tail), len(tail))
    return crc & 0xFFFFFFFF


def self_test() -> None:
    """The arithmetic against zlib (torch-ops lanes; with TRITON_INTERPRET=1 also the Triton kernel, interpreted)."""
    rng = np.random.default_rng(0)
    tri = os.environ.get("TRITON_INTERPRET") == "1"
    sizes = (0, 1, 3, 4095, 4096, 4097, 8192, 3 * 4096 + 5, 5 * 4096, 64 * 1024 + 7, (1 << 20) + 3)
    for n in sizes:
        data = rng.integers(0, 256, n, dtype=np.uint8)
        want = zlib.crc32(data.tobytes())
        for use in ((False, True) if tri else (False,)):
            if use and n > 64 * 1024 + 7:
                continue  # the interpreter is slow
            got = crc32_device(torch.from_numpy(data), use_triton=use)
            assert got == want, (n, use, hex(got), hex(want))
    print(f"self-test ok: CRC-32 by lanes and a tree equals zlib's on {len(sizes)} sizes" + (" (and the Triton kernel, interpreted)" if tri else ""))


def main() -> None:
    if os.environ.get("PROBE_CPU") == "1":
        return self_test()
    from concurrent.futures import ThreadPoolExecutor

    from checkpointd import bulkcopy, fastload, pagemem
    from checkpointd.crc import crc32

    gb = float(sys.argv[1]) if len(sys.argv) > 1 and not sys.argv[1].startswith("-") else 4.83
    out = sys.argv[sys.argv.index("--json") + 1] if "--json" in sys.argv else None
    n = int(gb * 1e9) // 4096 * 4096 + 12345  # a tail past the last whole lane
    path = "/dev/shm/ckd-gpucrc.bin"
    g = torch.Generator().manual_seed(0)
    with open(path, "wb") as f:
        block = torch.randn(64 << 18, generator=g).view(torch.uint8).numpy().tobytes()  # 64 MiB
        left = n
        while left:
            k = min(left, len(block))
            f.write(block[:k])
            left -= k
    try:
        import triton  # noqa: F401
        have_triton = True
    except ImportError:
        have_triton = False
    dev = torch.device("cuda")
    img = torch.empty(n, dtype=torch.uint8, device=dev)
    other = torch.empty(n, dtype=torch.uint8, device=dev)
    pool = ThreadPoolExecutor(16)
    R = 32 << 20
    rows: dict[str, list[float]] = {}

    def rec(name, secs):
        rows.setdefault(name, []).append(secs * 1e3)

    def fresh_map():
        fd = os.open(path, os.O_RDONLY)
        try:
            return fastload._map_file(fd, n)
        finally:
            os.close(fd)
    ref = None
    print(f"file {n / 1e9:.2f} GB, triton {have_triton}", flush=True)
    for r in range(int(os.environ.get("PROBE_ROUNDS", "5"))):
        m = fresh_map()
        v = fastload.byte_view(m)
        t0 = time.perf_counter()
        list(pool.map(lambda a: pagemem.populate_read(m.data_ptr() + a, min(R, n - a)), range(0, n, R)))
        rec("populate", time.perf_counter() - t0)
        t0 = time.perf_counter()
        parts = list(pool.map(lambda a: (crc32(v[a:a + R]), min(R, n - a)), range(0, n, R)))
        rec("cpu crc", time.perf_counter() - t0)
        from checkpointd.crc import crc32_concat
        ref = crc32_concat(parts)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        bulkcopy._bounced_h2d(dev, [(img, m)])
        torch.cuda.synchronize()
        rec("upload (populated)", time.perf_counter() - t0)
        del v, m
        m = fresh_map()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        bulkcopy._bounced_h2d(dev, [(img, m)])
        torch.cuda.synchronize()
        rec("upload (fresh mapping)", time.perf_counter() - t0)
        tail = bytes(fastload.byte_view(m)[n // 4096 * 4096:])
        del m
        for name, tri in (("gpu crc (triton)", True), ("gpu crc (torch ops)", False)):
            if tri and not have_triton:
                continue
            if not tri and r > 0:
                continue  # ~1k launches a word column: once is enough
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            got = crc32_device(img, host_tail=tail, use_triton=tri)
            torch.cuda.synchronize()
            rec(name, time.perf_counter() - t0)
            if got != ref:
                print(f"MISMATCH {name}: {got:#010x} != {ref:#010x}", flush=True)
                rows.setdefault("mismatch", []).append(1.0)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        other.copy_(img)
        torch.cuda.synchronize()
        rec("d2d", time.perf_counter() - t0)
        print(f"round {r}: " + "  ".join(f"{k} {xs[-1]:.1f}" for k, xs in rows.items()), flush=True)
    print("\nms (first / best / median):")
    for k, xs in rows.items():
        print(f"  {k:24s} {xs[0]:8.1f} {min(xs):8.1f} {statistics.median(xs):8.1f}")
    print("crc ok:", "mismatch" not in rows, f"(ref {ref:#010x})")
    if out:
        with open(out, "w") as f:
            json.dump({"bytes": n, "triton": have_triton, "rows": rows}, f, indent=1)
    os.unlink(path)


if __name__ == "__main__":
    main()
