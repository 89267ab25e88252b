"""Bit-exact comparison of nested state (dicts, lists, tuples, tensors, plain values) for tests."""

from __future__ import annotations

import os
from typing import Any

import torch

from checkpointd.storage import recyclebin


def assert_tree_equal(a: Any, b: Any, where: str = "", *, strides: bool = True) -> None:
    """``a`` and ``b`` have the same structure, equal plain values and bit-identical tensors (same
    dtype, shape and, with ``strides``, memory layout). ``where`` names the path in failures."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype, f"{where}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{where}: shape {a.shape} != {b.shape}"
        if strides:
            assert a.stride() == b.stride(), f"{where}: stride {a.stride()} != {b.stride()}"
        assert torch.equal(a, b), f"{where}: values differ (max abs diff {(a.double() - b.double()).abs().max()})"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys {sorted(a, key=str)} != {sorted(b, key=str)}"
        for k in a:
            assert_tree_equal(a[k], b[k], f"{where}[{k!r}]", strides=strides)
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{where}: {a!r} != {b!r}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_tree_equal(x, y, f"{where}[{i}]", strides=strides)
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def big_files(root) -> dict[str, os.stat_result]:
    """Files under ``root`` large enough to be recycled, by path relative to ``root``."""
    out = {}
    for dirpath, _, names in os.walk(root):
        for n in names:
            p = os.path.join(dirpath, n)
            st = os.stat(p)
            if st.st_size >= recyclebin.MIN_RECYCLE_BYTES:
                out[os.path.relpath(p, root)] = st
    return out
