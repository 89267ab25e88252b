"""checkpointd: asynchronous background checkpoints for PyTorch training.

The public API (SPEC §1)::

    from checkpointd import CheckpointManager, load, CheckpointError, CheckpointWriteError

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
    UnsafeCheckpointError,
)
from checkpointd.load import load  # noqa: E402
from checkpointd.manager import CheckpointManager  # noqa: E402
from checkpointd.options import DistributedOptions, IOOptions, StagingOptions  # noqa: E402

__all__ = [
    "CheckpointManager",
    "load",
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
    "UnsafeCheckpointError",
    "__version__",
]
