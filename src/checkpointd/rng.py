"""RNG state (Python, NumPy, torch CPU and CUDA): captured with every checkpoint, restored with it.

Stored as plain containers and tensors so it loads with ``torch.load(weights_only=True)``.
In a distributed run each rank stores its own; see ``restore_rng`` for world-size changes.
"""

from __future__ import annotations

import random
from typing import Any, cast

import torch

try:  # NumPy is optional
    import numpy as _np
except ImportError:  # pragma: no cover
    _np = None  # type: ignore[assignment]


def capture_rng() -> dict[str, Any]:
    """Snapshot of every RNG the training loop may draw from. Cheap (a few KiB), taken synchronously."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "torch": torch.get_rng_state(),
    }
    if _np is not None:
        legacy = cast("tuple[str, _np.ndarray, int, int, float]", _np.random.get_state(legacy=True))
        kind, keys, pos, has_gauss, cached = legacy
        state["numpy"] = [str(kind), torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached)]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.clone() for s in torch.cuda.get_rng_state_all()]
    return state


def check_rng(state: Any) -> None:
    """Raise (TypeError, ValueError, RuntimeError, ...) unless :func:`restore_rng` can put ``state`` back:
    each part is set on a throwaway generator, so a malformed state is refused before anything of a
    restore is applied."""
    if not isinstance(state, dict):
        raise TypeError(f"the RNG state is a {type(state).__name__}, not a dict")
    if "python" in state:
        version, internal, gauss = state["python"]
        random.Random().setstate((int(version), tuple(int(x) for x in internal), gauss))
    if "torch" in state:
        torch.Generator().set_state(state["torch"].cpu())
    if "numpy" in state and _np is not None:
        kind, keys, pos, has_gauss, cached = state["numpy"]
        _np.random.RandomState().set_state((kind, keys.numpy().astype("uint32"), int(pos), int(has_gauss), float(cached)))
    if "cuda" in state:
        if not all(isinstance(s, torch.Tensor) and s.dtype == torch.uint8 for s in state["cuda"]):
            raise TypeError("the CUDA RNG states are not byte tensors")


def restore_rng(state: dict[str, Any]) -> None:
    """Put every RNG back as captured; CUDA states only for the devices both sides have."""
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((int(version), tuple(int(x) for x in internal), gauss))
    if "torch" in state:
        torch.set_rng_state(state["torch"].cpu())
    if "numpy" in state and _np is not None:
        kind, keys, pos, has_gauss, cached = state["numpy"]
        _np.random.set_state((kind, keys.numpy().astype("uint32"), int(pos), int(has_gauss), float(cached)))
    if "cuda" in state and torch.cuda.is_available():
        saved = state["cuda"]
        for idx in range(min(len(saved), torch.cuda.device_count())):
            torch.cuda.set_rng_state(saved[idx].cpu(), idx)
