"""The one exception hierarchy of checkpointd.

Every error the library raises derives from :class:`CheckpointError`, so a training script can catch
the library's failures in one place. Subclasses also derive from the builtin that fits (``ValueError``,
``FileNotFoundError``, ``TimeoutError``, ...), so code that already catches builtins keeps working.
Messages name the object, the key and what to do next.
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Root of every error raised by checkpointd."""


class ConfigError(CheckpointError, ValueError):
    """Bad constructor or CLI options; raised before anything is written."""


class StateError(CheckpointError, TypeError):
    """Registered state that cannot be checkpointed (unserializable object, meta tensor, bad key).

    Raised from ``maybe_save`` (or the constructor) itself; nothing is written.
    """


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No committed checkpoint (or no such step) under the given path."""


class IncompleteCheckpointError(CheckpointError):
    """A step directory without a commit marker, or whose marker does not match its manifest."""


class CorruptCheckpointError(CheckpointError, ValueError):
    """A committed checkpoint whose files fail verification (size, checksum, or format)."""


class StepAlreadyExistsError(CheckpointError, FileExistsError):
    """Saving a step that is already committed without ``overwrite=True``."""


class ManifestError(CheckpointError, ValueError):
    """A manifest that cannot be read, or was written by a newer, incompatible format version."""


class StateMismatchError(CheckpointError, ValueError):
    """The restore target's keys, shapes or types differ from what the checkpoint holds."""


class UnsafeCheckpointError(CheckpointError, ValueError):
    """A checkpoint file whose pickle references code outside the safe allow-list; nothing was run."""


class UnacceptedSubclassError(CheckpointError, ValueError):
    """A checkpoint holds a tensor subclass that this process has not imported or does not accept.

    The caller's set-up, not damage: unlike an :class:`UnsafeCheckpointError` (a file whose pickle
    reaches outside the safe allow-list), it is not in :data:`NOT_VERIFIED`, so a restore stops here
    instead of skipping (and setting aside) the step, and the message says what to import or allow.
    Nothing of the class was run.
    """


class RootInUseError(CheckpointError):
    """Another live writer holds the checkpoint root's lease (one writer per root); the message names it.

    Raised by the first save of a manager whose root another process (or manager) is saving into, and
    by a later save of a manager whose lease another writer took over after it expired.
    """


class LinkedPathError(CheckpointError, OSError):
    """A path below a local checkpoint root leads through a symbolic link: nothing is deleted, written
    or read through it (the message names the link and says to remove it)."""


class CheckpointWriteError(CheckpointError):
    """A background save failed; raised by the next ``maybe_save``/``wait``/``close``.

    Attributes:
        step: the step whose save failed.
    """

    def __init__(self, message: str, step: int | None = None) -> None:
        super().__init__(message)
        self.step = step


class CheckpointTimeoutError(CheckpointError, TimeoutError):
    """``wait(timeout)`` or ``close(timeout)`` ran out before every started save was committed."""


NOT_VERIFIED = (CorruptCheckpointError, IncompleteCheckpointError, ManifestError, UnsafeCheckpointError)
"""What makes a restore skip a step and take it out of the checkpoints: damaged, malformed or unsafe content."""
