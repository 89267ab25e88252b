"""checkpointd: asynchronous background checkpoints for PyTorch training.

The public API (SPEC §1)::

    from checkpointd import CheckpointManager, load, CheckpointError, CheckpointWriteError

Tensor subclasses (torchao's quantized tensors) are stored bit-exactly through their inner tensors;
:func:`allow_tensor_subclasses` accepts classes beyond the built-in torchao ones, and
``load(..., dequantize=True)`` gives plain copies (:func:`register_dequantizer` for other classes).

The manager's tuning knobs are grouped in :class:`StagingOptions`, :class:`IOOptions` and
:class:`DistributedOptions` (``options.py``).

Follow a save from :meth:`CheckpointManager.maybe_save` in ``manager.py``: its module docstring lists
the pipeline stages and the module that implements each.
"""

from checkpointd.version import VERSION as __version__  # noqa: E402

from checkpointd.errors import (  # noqa: E402
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointTimeoutError,
    CheckpointWriteError,
    ConfigError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    LinkedPathError,
    ManifestError,
    RootInUseError,
    StateError,
    StateMismatchError,
    StepAlreadyExistsError,
    UnacceptedSubclassError,
    UnsafeCheckpointError,
)
from checkpointd.format.dequantize import register_dequantizer  # noqa: E402
from checkpointd.format.subclass_sharding import register_inner_sharding  # noqa: E402
from checkpointd.format.subclasses import allow_tensor_subclasses  # noqa: E402
from checkpointd.load import load  # noqa: E402
from checkpointd.manager import CheckpointManager  # noqa: E402
from checkpointd.options import DistributedOptions, IOOptions, StagingOptions  # noqa: E402

__all__ = [
    "CheckpointManager",
    "load",
    "allow_tensor_subclasses",
    "register_dequantizer",
    "register_inner_sharding",
    "DistributedOptions",
    "IOOptions",
    "StagingOptions",
    "CheckpointError",
    "CheckpointWriteError",
    "CheckpointNotFoundError",
    "CheckpointTimeoutError",
    "ConfigError",
    "CorruptCheckpointError",
    "IncompleteCheckpointError",
    "LinkedPathError",
    "ManifestError",
    "RootInUseError",
    "StateError",
    "StateMismatchError",
    "StepAlreadyExistsError",
    "UnacceptedSubclassError",
    "UnsafeCheckpointError",
    "__version__",
]
