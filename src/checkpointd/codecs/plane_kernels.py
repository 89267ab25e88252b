"""The byte-plane transform of the ``zstd-planes`` codec: split and rotate, nibble packing, merge and rotate back.

Each pass runs in :mod:`checkpointd.native.planes` (C, one pass over cache-sized blocks, built on first
use) wherever that library loads, and in the NumPy kernels here otherwise; both produce the same bytes.
With the Huffman coder beside them (:mod:`checkpointd.codecs.huffman`, native too), a 2-core VM runs
``zstd-planes`` at 1.4-2.8 GB/s compress and 1.2-3.5 GB/s decompress natively, against 0.04-0.14 and
0.02-0.09 GB/s in NumPy (``bench_compression.py --mb 32``, native code off for NumPy): the
NumPy path keeps files readable where nothing could be compiled, not fast.

Why the NumPy kernels are few, big calls: each call drops and retakes the GIL, and with 16 codec
threads every retake waits for a hand-off (futex wake-ups, tens of microseconds), so on a 16-core host
the calls per MiB, not one core's speed, bound throughput. Blocks are :data:`MERGE_BYTES`, 4-byte
elements merge by byte columns (4 calls a block), 2- and 8-byte elements by a widen / multiply / OR
tree. Casting ufuncs, ``np.einsum``, whole-chunk blocks, ``np.divmod``, ``np.take`` on a table and
``np.place``/``np.putmask`` for escapes are each slower than the shapes used here.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from checkpointd.codecs.zstd_frames import scratch
from checkpointd.errors import CorruptCheckpointError
from checkpointd.native import planes as planes_native

ESCAPE = 15
"""The nibble code that marks a value outside the 15-value window (stored after the codes). Nibble planes
are read, not written: files of earlier releases hold them."""
NIBBLES = struct.Struct("<BxxxI")
"""Header of a nibble-packed plane: base, escape count; one zstd frame of codes and escapes follows."""
UINT_BY_ITEMSIZE: dict[int, type[np.unsignedinteger[Any]]] = {2: np.uint16, 4: np.uint32, 8: np.uint64}
"""Element sizes that planes are cut at, with the unsigned type of that size."""
_INT_BY_ITEMSIZE = {2: np.int16, 4: np.int32, 8: np.int64}

MERGE_BYTES = 4 << 20
"""Output bytes merged (and input bytes split) per block: 4 calls a block for 4-byte elements. Every NumPy
call drops and retakes the GIL, so fewer, bigger calls; 4 MiB still mostly stays in L2/L3."""


def to_planes(view: Any, itemsize: int, out: np.ndarray | None = None) -> np.ndarray:
    """(itemsize, n) planes of the rotated elements in ``view`` (whole elements only), into ``out`` (uint8,
    that shape, rows contiguous) or a fresh array.

    Plane ``j`` is byte ``j`` of each element rotated left by one bit, computed without materializing
    the rotation or transposing bytes: for ``j >= 1`` it is ``x >> (8j - 1)`` truncated to a byte (one
    contiguous shift into per-thread scratch, one SIMD narrowing copy); plane 0 is ``x`` truncated,
    doubled, with the sign bit added. Every pass is contiguous, about 2-3x faster than the strided byte
    copies of a transpose. (NumPy's ``uint8`` left shift is scalar code; multiplying by 2 is not.)
    """
    count = memoryview(view).nbytes // itemsize
    planes = np.empty((itemsize, count), dtype=np.uint8) if out is None else out
    lib = planes_native.library()
    if lib is not None and count:
        planes_native.split_planes(lib, view, itemsize, count, planes)
        return planes
    all_elems = np.frombuffer(view, dtype=UINT_BY_ITEMSIZE[itemsize], count=count)
    block = MERGE_BYTES // itemsize
    for start in range(0, count, block):
        stop = min(count, start + block)
        elems = all_elems[start:stop]
        shifted = scratch("shifted", (stop - start) * itemsize).view(elems.dtype)
        for j in range(1, itemsize):
            np.right_shift(elems, 8 * j - 1, out=shifted)
            np.copyto(planes[j, start:stop], shifted, casting="unsafe")
        low = planes[0, start:stop]
        np.copyto(low, elems, casting="unsafe")
        np.multiply(low, 2, out=low)
        sign = scratch("sign", stop - start)
        np.less(elems.view(_INT_BY_ITEMSIZE[itemsize]), 0, out=sign.view(np.bool_))
        low |= sign
    return planes


def unpack_nibbles(base: int, escaped: int, packed: np.ndarray, plane: np.ndarray) -> None:
    """Decode a nibble plane (``docs/format.md``, plane mode 2, written by earlier releases) into ``plane``:
    5 NumPy calls.

    Escapes are put back by a boolean-mask assignment, which fills the masked places in order (what
    the format stores) in one call, skipping runs of unmasked bytes a word at a time: a bf16 chunk
    (1298 escapes in 8 Mi values) takes 2 GIL releases and 0.9 ms; finding the positions first takes
    0.33 ms but ~10 releases.
    """
    count, half = plane.size, (plane.size + 1) // 2
    np.right_shift(packed[:half], 4, out=plane[:half])
    np.bitwise_and(packed[: count - half], 15, out=plane[half:])
    if escaped:
        mask = scratch("mask", count).view(np.bool_)
        np.equal(plane, ESCAPE, out=mask)
    plane += np.uint8(base)
    if escaped:
        values = packed[half : half + escaped]
        where: np.ndarray = np.flatnonzero(mask) if escaped == 1 else mask  # 1 value would broadcast
        try:
            if where.size != 1 and where.dtype != np.bool_:
                raise ValueError
            plane[where] = values
        except ValueError:
            found = np.count_nonzero(mask)
            raise CorruptCheckpointError(f"nibble plane has {found} escape codes, its header says {escaped}") from None


def from_planes(planes: list[np.ndarray], out: np.ndarray, rotated: bool = True) -> None:
    """Interleave ``planes`` (byte ``j`` of each element in ``planes[j]``) into ``out``, rotate back.

    Runs in blocks of :data:`MERGE_BYTES` of output, a few NumPy calls each (see :func:`_merge_columns`
    and :func:`_merge_tree` for which shape each element size gets).
    """
    itemsize = len(planes)
    count = planes[0].shape[0]
    block = MERGE_BYTES // itemsize
    merge = _merge_columns if itemsize == 4 else _merge_tree
    for start in range(0, count, block):
        stop = min(count, start + block)
        merge([p[start:stop] for p in planes], out[start * itemsize : stop * itemsize])
        if rotated:
            _rotate_right(out[start * itemsize : stop * itemsize].view(UINT_BY_ITEMSIZE[itemsize]))


def _merge_columns(planes: list[np.ndarray], out: np.ndarray) -> None:
    """4-byte elements: plane 0 widened into ``out``, planes 1-3 copied into its byte columns.

    The strided byte copies are scalar loops (~1 cycle a byte) but insensitive to block size, and
    they take 4 calls where the widen / multiply / OR tree takes 12: 0.55 vs 0.6 ms per MiB of
    elements on one core at 4 MiB blocks.
    """
    elems = out.view(np.uint32)
    np.copyto(elems, planes[0])  # byte 0, upper bytes zero
    columns = out.reshape(-1, 4)
    for j in (1, 2, 3):
        columns[:, j] = planes[j]


def _merge_tree(planes: list[np.ndarray], out: np.ndarray) -> None:
    """2- and 8-byte elements: planes paired into 2-byte words by widen / multiply / OR passes.

    The low plane of a pair is ORed in as bytes (a casting ufunc: NumPy widens it a buffer at a time,
    in cache), so a pair takes 3 calls and no widened temporary. For 8-byte elements the 2-byte words
    go into ``out``'s columns by strided copies (a further tree level costs more than it saves); byte
    columns instead cost a strided byte copy per plane, slower here (bf16 2.8 vs 4.2 ms per 16 MiB).
    """
    itemsize = len(planes)
    count = planes[0].shape[0]
    words = out.view(np.uint16)
    columns = words.reshape(count, itemsize // 2)
    for c in range(itemsize // 2):
        dst = words if itemsize == 2 else scratch("merge_word", 2 * count).view(np.uint16)
        np.copyto(dst, planes[2 * c + 1])
        np.multiply(dst, np.uint16(256), out=dst)  # << 8 (shifts are slower)
        np.bitwise_or(dst, planes[2 * c], out=dst)
        if itemsize != 2:
            columns[:, c] = dst


def _rotate_right(elems: np.ndarray) -> None:
    """Rotate unsigned ``elems`` right by one bit in place (3 calls)."""
    uint = elems.dtype.type
    low = scratch("low", elems.nbytes).view(uint)
    np.right_shift(elems, 1, out=low)
    np.multiply(elems, uint(1 << (elems.itemsize * 8 - 1)), out=elems)
    elems |= low


__all__ = ["ESCAPE", "MERGE_BYTES", "NIBBLES", "UINT_BY_ITEMSIZE", "from_planes", "to_planes",
           "unpack_nibbles"]
