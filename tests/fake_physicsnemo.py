"""A stand-in for ``physicsnemo.core.Module`` in tests that must not need PhysicsNeMo installed.

checkpointd recognises PhysicsNeMo modules by duck typing (``__model_checkpoint_version__`` and the
``_args`` record that ``Module.__new__`` keeps of the constructor's arguments), so this is all a test
needs to get ``.mdlus`` files. The interop tests use the real package (``tests/physicsnemo_env.py``).
"""

from __future__ import annotations

from typing import Any

import torch


class FakePNModule(torch.nn.Module):
    """Records its __init__ arguments like physicsnemo.core.Module.__new__ does."""

    __model_checkpoint_version__ = "0.1.0"

    def __new__(cls, *args: Any, **kwargs: Any) -> "FakePNModule":
        out = super().__new__(cls)
        out._args = {"__name__": cls.__name__, "__module__": cls.__module__, "__args__": dict(kwargs)}
        return out
