"""``checkpointd``: list, inspect, verify, export and clean up checkpoints from the shell (SPEC §1).

The package, by responsibility:

- ``__init__.py``     ``main``: parse, run the command, turn any failure into one stderr line and an exit code
- ``parser.py``       the commands, their options and help
- ``listing.py``      ``ls`` and ``inspect``
- ``maintenance.py``  ``verify``, ``export`` and ``gc``
- ``stores.py``       opening stores, with storage retries shown on stderr (:class:`RetryReporter`)
- ``output.py``       tables, JSON, sizes and times, the progress bar
- ``exits.py``        the exit codes (part of the interface; see ``EXIT_CODES`` and ``checkpointd --help``)

Human output goes to stdout, messages and the progress bar to stderr (the bar only when stderr is a
terminal); ``--json`` prints one JSON document for scripts. A failure ends with one line on stderr,
never a traceback (but for a bug in checkpointd itself).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import sys
from collections.abc import Sequence
from typing import Any

from checkpointd.cli.exits import (EXIT_CODES, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_PIPE_CLOSED,
                                   EXIT_UNREACHABLE, EXIT_USAGE, Usage)
from checkpointd.cli.output import Output, OutputClosed, Progress, err, one_line, silence_stdout
from checkpointd.cli.parser import build_parser, parse_storage_options
from checkpointd.cli.stores import RetryReporter
from checkpointd.errors import CheckpointError, CheckpointNotFoundError, ConfigError, UnacceptedSubclassError

__all__ = ["EXIT_CODES", "EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_PIPE_CLOSED", "EXIT_UNREACHABLE",
           "EXIT_USAGE", "Progress", "RetryReporter", "build_parser", "main", "parse_storage_options"]


# -- entry point --------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (``python -m checkpointd`` exits with it)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return int(exc.code or 0) if isinstance(exc.code, int) else EXIT_USAGE
    if not getattr(args, "command", None):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    args.reporter = RetryReporter()
    try:
        with _library_warnings_on_stderr(), contextlib.redirect_stdout(Output(sys.stdout)):
            args.storage_options = parse_storage_options(args.storage_option)
            _import(getattr(args, "imports", []))
            return int(args.run(args))
    except KeyboardInterrupt:
        err("interrupted")
        return EXIT_INTERRUPTED
    except Exception as exc:  # noqa: BLE001 - every failure ends with one line; a bug still shows its traceback
        code = _failure(exc, args.reporter)
        if code is None:
            raise
        return code


def _import(modules: Sequence[str]) -> None:
    """``--import``: the modules whose tensor subclasses the command may rebuild (see ``checkpointd.load``)."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise Usage(f"--import {name}: {one_line(exc, with_type=False)}") from exc


@contextlib.contextmanager
def _library_warnings_on_stderr() -> Any:
    """The library's warnings as ``checkpointd: warning: ...`` lines on stderr, but for its retry records:
    the :class:`RetryReporter` tells of those."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter("checkpointd: warning: %(message)s"))
    handler.addFilter(lambda record: not hasattr(record, "retry_event"))
    lib_logger = logging.getLogger("checkpointd")
    lib_logger.addHandler(handler)
    try:
        yield
    finally:
        lib_logger.removeHandler(handler)


def _failure(exc: BaseException, reporter: RetryReporter) -> int | None:
    """Print the one error line for ``exc`` and return the exit code; None for an unexpected error."""
    if isinstance(exc, OutputClosed):
        silence_stdout()
        return EXIT_PIPE_CLOSED
    gave_up = reporter.gave_up_on(exc)
    if gave_up is not None:
        url, event = gave_up
        tried = f"{event.attempt} attempts" if event.attempt > 1 else "1 attempt"
        err(f"error: cannot reach {url} after {event.elapsed_secs:.1f} s of retries ({tried}): "
            f"{one_line(event.error)}. Check the endpoint and credentials (or raise --retry-timeout).")
        return EXIT_UNREACHABLE
    if isinstance(exc, (Usage, ConfigError, CheckpointNotFoundError)):
        err(f"error: {one_line(exc, with_type=False, limit=None)}")
        return EXIT_USAGE
    if isinstance(exc, UnacceptedSubclassError):  # the library says what to import: here, with --import
        err(f"error: {one_line(exc, limit=None)} (on the command line: --import MODULE)")
        return EXIT_FAILED
    if isinstance(exc, CheckpointError):
        err(f"error: {one_line(exc, limit=None)}")
        return EXIT_FAILED
    if isinstance(exc, (FileNotFoundError, NotADirectoryError)):
        err(f"error: {one_line(exc, with_type=False)}")
        return EXIT_USAGE
    backend = _raised_by_backend(exc)
    if isinstance(exc, TypeError) and backend:  # an option the backend does not take
        err(f"error: {one_line(exc)}; check the --storage-option values")
        return EXIT_USAGE
    if isinstance(exc, (OSError, ImportError, ValueError)) or backend:
        err(f"error: {one_line(exc)}")  # storage down, backend not installed, bad URL, no credentials
        return EXIT_FAILED
    return None


def _innermost_module(exc: BaseException) -> str:
    """The module whose code raised ``exc`` (the innermost Python frame of its traceback)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return str(tb.tb_frame.f_globals.get("__name__", "")) if tb is not None else ""


_BACKEND_MODULES = frozenset({"botocore", "aiobotocore", "boto3", "aiohttp", "s3fs", "gcsfs", "google", "adlfs",
                              "azure", "fsspec", "urllib3", "requests"})


def _raised_by_backend(exc: BaseException) -> bool:
    """Whether a storage backend library raised ``exc`` (no credentials, access denied, an option it does
    not take), rather than checkpointd itself (a bug, whose traceback is wanted)."""
    return any(module.split(".", 1)[0] in _BACKEND_MODULES for module in (type(exc).__module__, _innermost_module(exc)))
