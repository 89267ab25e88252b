"""The command line's exit codes (part of its interface) and the exception for "nothing to act on"."""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_INTERRUPTED = 130
EXIT_PIPE_CLOSED = 141
EXIT_CODES = {
    EXIT_OK: "success (ls: at least one committed step; verify: every checked step verifies)",
    EXIT_FAILED: "a checkpoint failed verification or could not be read, exported or removed "
                 "(corrupt, uncommitted, unsafe pickle, newer format, storage error)",
    EXIT_USAGE: "usage error, or nothing to act on: no such path, a file where a directory is needed, "
                "no step directory, no committed step (ls, verify)",
    EXIT_UNREACHABLE: "storage unreachable: connection errors, timeouts or throttling outlasted --retry-timeout",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C)",
    EXIT_PIPE_CLOSED: "the reader of the output went away (e.g. piped into head); nothing is printed",
}
"""Each exit code and when a command ends with it (printed by ``checkpointd --help``)."""


class Usage(Exception):
    """Nothing to act on (exit 2)."""


__all__ = ["EXIT_CODES", "EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_PIPE_CLOSED", "EXIT_UNREACHABLE",
           "EXIT_USAGE", "Usage"]
