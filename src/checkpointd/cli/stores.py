"""Opening the stores the command line reads, with storage retries shown on stderr while they happen.

Storage calls are retried on transient errors for ``--retry-timeout`` seconds (the library's two
minutes by default); :class:`RetryReporter` says so on stderr, and remembers each call that gave up
so that the failure ends with one line naming the unreachable URL. Also here: telling a step
directory from a root.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from typing import Any, Callable, TextIO

from checkpointd import commit
from checkpointd.cli.exits import Usage
from checkpointd.cli.output import one_line
from checkpointd.errors import ConfigError, IncompleteCheckpointError
from checkpointd.format import layout
from checkpointd.storage.retry import RetryEvent, RetryPolicy
from checkpointd.storage.store import Store

DEFAULT_RETRY_TIMEOUT_SECS = RetryPolicy().max_elapsed_secs
"""``--retry-timeout`` default: the library's own budget (two minutes)."""
PROGRESS_INTERVAL_SECS = 5.0
"""At most one retry progress line per this many seconds (the first failure is reported at once)."""


class RetryReporter:
    """Shows storage retries on stderr while they happen, and remembers each call that gave up.

    Installed by the command line on every :class:`Store` it opens (``RetryPolicy.on_retry``); the
    library itself never prints. The first transient failure is reported at once, later ones at most
    every ``interval_secs``. Thread-safe.
    """

    def __init__(self, stream: TextIO | None = None, interval_secs: float = PROGRESS_INTERVAL_SECS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stream = stream
        self.interval_secs = interval_secs
        self.clock = clock
        self._last_line: float | None = None
        self._gave_up: list[tuple[str, RetryEvent]] = []
        self._lock = threading.Lock()

    def hook(self, url: str) -> Callable[[RetryEvent], None]:
        """The ``on_retry`` callback for the store at ``url`` (the name its messages use)."""
        return lambda event: self.report(url, event)

    def report(self, url: str, event: RetryEvent) -> None:
        with self._lock:
            if event.giving_up:
                self._gave_up.append((url, event))
                return
            now = self.clock()
            if self._last_line is not None and now - self._last_line < self.interval_secs:
                return
            self._last_line = now
        print(f"checkpointd: cannot reach {url}: {one_line(event.error)}; retrying for another "
              f"{event.remaining_secs:.0f} s (attempt {event.attempt + 1})", file=self.stream or sys.stderr, flush=True)

    def gave_up_on(self, exc: BaseException) -> tuple[str, RetryEvent] | None:
        """``(url, event)`` of the retried call whose error ``exc`` is (or was raised from), if any."""
        chain: list[BaseException] = []
        cause: BaseException | None = exc
        while cause is not None and len(chain) < 20 and all(cause is not seen for seen in chain):
            chain.append(cause)
            cause = cause.__cause__ or cause.__context__
        with self._lock:
            for url, event in reversed(self._gave_up):
                if any(event.error is e for e in chain):
                    return url, event
        return None


def open_store(path: str, args: argparse.Namespace) -> Store:
    """A Store whose calls retry for ``--retry-timeout`` seconds, reporting on stderr as they do."""
    policy = RetryPolicy(max_elapsed_secs=args.retry_timeout, on_retry=args.reporter.hook(path))
    options = backend_options(path, args.storage_options)
    try:
        return Store(path, options, retry=policy)
    except (TypeError, ValueError) as exc:  # the backend refuses an option or the URL
        raise ConfigError(f"cannot open {path} with storage options {sorted(options)}: {one_line(exc)}") from exc


def backend_options(path: str, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` for ``path``'s backend. On s3:// one attempt per request (botocore retries a refused
    connection for seconds on its own, unseen): the Store's policy retries instead, with progress on
    stderr, for ``--retry-timeout`` seconds. An explicit ``config_kwargs`` "retries" wins."""
    if path.split("://", 1)[0] not in ("s3", "s3a"):
        return options
    config = options.get("config_kwargs", {})
    if not isinstance(config, dict) or "retries" in config:
        return options
    return {**options, "config_kwargs": {**config, "retries": {"total_max_attempts": 1}}}


def open_existing(path: str, args: argparse.Namespace) -> Store:
    """:func:`open_store` for a path that must hold something.

    Raises:
        Usage: nothing at ``path`` (an empty directory, or no such file or directory).
    """
    store = open_store(path, args)
    if not store.is_file("") and not store.list_dir(""):
        if store.exists(""):
            raise Usage(f"nothing at {store.display()}: the directory is empty")
        raise Usage(f"nothing at {store.display()}: no such file or directory")
    return store


def has_valid_marker(store: Store) -> bool:
    """Whether the step directory ``store`` has a commit marker that is valid on its own (its manifest may
    still not match it: the step is then damaged, not uncommitted)."""
    try:
        commit.read_marker(store, "")
        return True
    except IncompleteCheckpointError:
        return False


def is_step_dir(store: Store) -> bool:
    """Whether ``store`` is a step directory (by its name, or a manifest or marker in it), not a root."""
    if layout.parse_step_dir_name(store.root) is not None:
        return True
    names = store.list_dir("")
    return layout.MANIFEST_NAME in names or layout.COMMIT_MARKER_NAME in names


__all__ = ["DEFAULT_RETRY_TIMEOUT_SECS", "PROGRESS_INTERVAL_SECS", "RetryReporter", "backend_options",
           "has_valid_marker", "is_step_dir", "open_existing", "open_store"]
