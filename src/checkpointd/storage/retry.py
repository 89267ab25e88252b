"""Retries with exponential backoff and full jitter, for transient storage errors only.

Why a module of our own: fsspec backends retry a little on their own (s3fs: 5 tries within ~2 s),
which does not ride out a storage outage of a minute, and they differ in what they call transient.
Here one policy decides for every backend, and it errs on the side of surfacing fast: a disk that is
full, a missing file or a denied permission is not going to fix itself within two minutes, so those
raise at once (SPEC §2: "retried with backoff where transient").

What counts as transient is decided by :func:`is_transient`, which recognises botocore/aiobotocore,
aiohttp and gcsfs errors by duck typing (class names, ``response`` dicts, ``code`` attributes), so no
cloud SDK is imported here. Errors that backends translate (s3fs turns ``ClientError`` into
``OSError``) are classified by their chained cause as well.

Who waits on a retrying call can be told: ``RetryPolicy(on_retry=...)`` is called with a
:class:`RetryEvent` for every transient failure (before the backoff sleep, and once more when the
budget is spent). The library itself never prints; the ``checkpointd`` command line installs a
reporter that shows the retries on stderr.

Limits: a call that hangs is not interrupted (a sync call cannot be cancelled safely); bound it in the
backend (s3fs ``config_kwargs={"read_timeout": ...}``) and the resulting ``TimeoutError`` is retried.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import logging
import random
import socket
import time
from collections.abc import Awaitable, Callable, Generator
from typing import Any, TypeVar

__all__ = ["NO_RETRY", "RetryEvent", "RetryPolicy", "is_transient"]

logger = logging.getLogger("checkpointd")

T = TypeVar("T")

TRANSIENT_ERRNOS = frozenset(
    getattr(errno, name)
    for name in (
        "EAGAIN", "EWOULDBLOCK", "EINTR", "EIO", "EBUSY", "ETIMEDOUT", "ECONNRESET", "ECONNREFUSED",
        "ECONNABORTED", "EPIPE", "EHOSTUNREACH", "EHOSTDOWN", "ENETUNREACH", "ENETDOWN", "ENETRESET",
        "EREMOTEIO", "ESTALE", "ENOLINK", "ECOMM", "EPROTO",
    )
    if hasattr(errno, name)
)
"""``OSError.errno`` values worth another try (network, server busy, flaky I/O)."""

PERMANENT_ERRNOS = frozenset(
    getattr(errno, name)
    for name in ("ENOSPC", "EDQUOT", "EROFS", "EFBIG", "ENAMETOOLONG", "EINVAL", "EACCES", "EPERM", "EEXIST")
    if hasattr(errno, name)
)
"""``OSError.errno`` values that never heal by waiting; disk full (ENOSPC/EDQUOT) must surface fast."""

_PERMANENT_TYPES: tuple[type[BaseException], ...] = (
    FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError,
    ValueError, TypeError, KeyError, AttributeError, NotImplementedError, MemoryError,
)

_TRANSIENT_CLASS_NAMES = frozenset({
    # botocore / aiobotocore (botocore.exceptions)
    "EndpointConnectionError", "ConnectionClosedError", "ReadTimeoutError", "ConnectTimeoutError",
    "ResponseStreamingError", "IncompleteReadError", "ProxyConnectionError", "HTTPClientError",
    "ConnectionError", "SSLError", "AWSConnectionError",
    # aiohttp
    "ClientConnectionError", "ClientConnectorError", "ServerDisconnectedError", "ClientPayloadError",
    "ClientOSError", "ServerTimeoutError", "ServerConnectionError",
    # fsspec, http.client, urllib3, requests
    "FSTimeoutError", "IncompleteRead", "RemoteDisconnected", "ProtocolError", "ChunkedEncodingError",
})

_TRANSIENT_S3_CODES = frozenset({
    "Throttling", "ThrottlingException", "ThrottledException", "SlowDown", "RequestLimitExceeded",
    "TooManyRequestsException", "ProvisionedThroughputExceededException", "RequestThrottled",
    "RequestTimeout", "RequestTimeoutException", "InternalError", "ServiceUnavailable",
    "OperationAborted", "BandwidthLimitExceeded", "PriorRequestNotComplete",
})

_TRANSIENT_HTTP_STATUS = frozenset({408, 425, 429})


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` is worth retrying: network trouble, timeouts, throttling, server 5xx.

    Permanent errors win over their causes: ``FileNotFoundError``, ``PermissionError``, disk full
    (``ENOSPC``/``EDQUOT``), ``ValueError`` and friends are never transient, whatever they chain to.
    """
    verdict = _classify(exc)
    if verdict is not None:
        return verdict
    # Backends translate errors (s3fs: ClientError -> OSError(EIO)); let the cause decide, then errno.
    chain = _cause_chain(exc)
    for cause in chain[1:]:
        verdict = _classify(cause)
        if verdict is not None:
            return verdict
    return any(isinstance(e, OSError) and e.errno in TRANSIENT_ERRNOS for e in chain)


def _cause_chain(exc: BaseException) -> list[BaseException]:
    chain = [exc]
    cause = exc.__cause__ or exc.__context__
    while cause is not None and all(cause is not seen for seen in chain):
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    return chain


def _classify(exc: BaseException) -> bool | None:
    """True/False when ``exc`` alone decides, ``None`` to ask its cause."""
    if not isinstance(exc, Exception):
        return False  # KeyboardInterrupt, SystemExit, CancelledError
    if isinstance(exc, OSError) and exc.errno in PERMANENT_ERRNOS:
        return False
    if isinstance(exc, _PERMANENT_TYPES):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError, socket.timeout, socket.gaierror)):
        return True
    http = _http_verdict(exc)
    if http is not None:
        return http
    if any(cls.__name__ in _TRANSIENT_CLASS_NAMES for cls in type(exc).__mro__):
        return True
    return None  # e.g. OSError(EIO): its cause may know better; errno decides last


def _http_verdict(exc: BaseException) -> bool | None:
    """Decide from a botocore ``response`` dict or an HTTP ``code``/``status`` attribute."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        error = response.get("Error") or {}
        code = str(error.get("Code", ""))
        status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        if code in _TRANSIENT_S3_CODES:
            return True
        if code.isdigit():
            status = status or int(code)
        if isinstance(status, int):
            return status >= 500 or status in _TRANSIENT_HTTP_STATUS
        return None
    for attr in ("status", "status_code", "code"):
        status = getattr(exc, attr, None)
        if isinstance(status, int) and 100 <= status <= 599:  # gcsfs HttpError.code, aiohttp .status
            return status >= 500 or status in _TRANSIENT_HTTP_STATUS
    return None


@dataclasses.dataclass(frozen=True)
class RetryEvent:
    """One transient failure of a retried call, as passed to ``RetryPolicy.on_retry``."""

    describe: str
    """What is retried, as the caller described it ("list s3://bucket/run"); may be empty."""
    attempt: int
    """Attempts made so far, the failed one included (1 for the first failure)."""
    error: BaseException
    """The transient error of this attempt."""
    elapsed_secs: float
    """Seconds since the first attempt began."""
    delay_secs: float
    """Sleep before the next attempt (0 when giving up)."""
    budget_secs: float
    """The policy's ``max_elapsed_secs``."""
    giving_up: bool
    """True: no further attempt; ``error`` is raised right after this event."""

    @property
    def remaining_secs(self) -> float:
        """Seconds of the budget left (0 when giving up)."""
        return 0.0 if self.giving_up else max(0.0, self.budget_secs - self.elapsed_secs)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """Exponential backoff with full jitter, bounded by total elapsed time.

    The n-th retry sleeps ``uniform(0, min(max_backoff_secs, initial_backoff_secs * multiplier**n))``
    ("full jitter"), so many writers hitting one throttled bucket spread out. A retry is only
    started if its sleep ends within ``max_elapsed_secs`` of the first attempt; otherwise the last
    error is re-raised unchanged (with a note saying how often it was tried), for the caller to wrap.

    Thread-safe: one policy can serve many threads (the jitter RNG is only read).
    """

    max_elapsed_secs: float = 120.0
    """Give up once this much time passed since the first attempt (SPEC §2: two minutes)."""
    initial_backoff_secs: float = 0.05
    """Backoff cap of the first retry."""
    max_backoff_secs: float = 5.0
    """Largest backoff cap, whatever the attempt number."""
    multiplier: float = 2.0
    """Growth of the backoff cap per attempt."""
    jitter: bool = True
    """Full jitter (sleep uniformly in [0, cap]); False sleeps exactly the cap (tests, debugging)."""
    max_attempts: int | None = None
    """Optional bound on attempts (first call included); ``None``: bounded by time only."""
    is_transient: Callable[[BaseException], bool] = dataclasses.field(default=is_transient, repr=False)
    """Which errors are retried; the default is :func:`is_transient`."""
    clock: Callable[[], float] = dataclasses.field(default=time.monotonic, repr=False, compare=False)
    """Monotonic clock in seconds (injectable for tests)."""
    sleep: Callable[[float], None] = dataclasses.field(default=time.sleep, repr=False, compare=False)
    """Blocking sleep used by :meth:`call` (injectable for tests)."""
    rng: random.Random | None = dataclasses.field(default=None, repr=False, compare=False)
    """Jitter source; ``None`` uses the ``random`` module."""
    on_retry: Callable[[RetryEvent], None] | None = dataclasses.field(default=None, repr=False, compare=False)
    """Called with a :class:`RetryEvent` on every transient failure: before each backoff sleep, and once
    with ``giving_up=True`` when the error is about to be raised. Runs on the retrying thread (or event
    loop), so it must be quick; an exception it raises is logged and ignored. Permanent errors, raised
    at once, are not reported. The log records of retries carry the same event (``record.retry_event``),
    so a handler can tell them apart."""

    def __post_init__(self) -> None:
        if self.max_elapsed_secs < 0:
            raise ValueError(f"max_elapsed_secs must be >= 0, got {self.max_elapsed_secs}")
        if self.initial_backoff_secs < 0 or self.max_backoff_secs < 0:
            raise ValueError("backoff seconds must be >= 0")
        if self.multiplier < 1:
            raise ValueError(f"multiplier must be >= 1, got {self.multiplier}")
        if self.max_attempts is not None and self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1 or None, got {self.max_attempts}")

    def backoff_cap(self, retry_index: int) -> float:
        """Upper bound of the sleep before retry number ``retry_index`` (0-based)."""
        try:
            cap = self.initial_backoff_secs * self.multiplier**retry_index
        except OverflowError:
            cap = self.max_backoff_secs
        return min(self.max_backoff_secs, cap)

    def call(self, fn: Callable[..., T], *args: Any, describe: str = "", **kwargs: Any) -> T:
        """``fn(*args, **kwargs)``, retried on transient errors.

        Args:
            fn: the operation; it must be safe to repeat (idempotent, or restarted from scratch).
            describe: what the operation is, for log lines and the give-up note ("write s3://b/x").

        Raises:
            The last error of ``fn`` once it is permanent or the time budget is spent.
        """
        attempts = self._attempts(describe)
        for _ in attempts:
            try:
                return fn(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - classified, then re-raised or retried
                delay = attempts.send(exc)
            self.sleep(delay)
        raise AssertionError("unreachable")  # pragma: no cover - the generator raises or returns

    async def call_async(
        self, fn: Callable[..., Awaitable[T]], *args: Any, describe: str = "", **kwargs: Any
    ) -> T:
        """Like :meth:`call` for a coroutine function; sleeps with ``asyncio.sleep``."""
        attempts = self._attempts(describe)
        for _ in attempts:
            try:
                return await fn(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001
                delay = attempts.send(exc)
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")  # pragma: no cover

    def _attempts(self, describe: str) -> Generator[float, Exception | None, None]:
        """Yields once per attempt; ``send(exc)`` returns the sleep before the next or raises ``exc``.

        A small state machine shared by the sync and async loops, so both decide identically.
        """
        start = self.clock()
        attempt = 0
        while True:
            attempt += 1
            exc = yield attempt
            if exc is None:  # pragma: no cover - only send() resumes us
                continue
            elapsed = self.clock() - start
            if not self.is_transient(exc):
                raise exc
            delay = self._delay(attempt - 1)
            out_of_attempts = self.max_attempts is not None and attempt >= self.max_attempts
            giving_up = out_of_attempts or elapsed + delay > self.max_elapsed_secs
            event = RetryEvent(describe=describe, attempt=attempt, error=exc, elapsed_secs=elapsed,
                               delay_secs=0.0 if giving_up else delay, budget_secs=self.max_elapsed_secs,
                               giving_up=giving_up)
            self._report(event)
            if giving_up:
                if attempt > 1:
                    exc.add_note(
                        f"checkpointd: gave up on {describe or 'the operation'} after {attempt} "
                        f"attempts in {elapsed:.1f}s (retry budget {self.max_elapsed_secs:g}s)"
                    )
                    logger.warning(
                        "giving up on %s after %d attempts in %.1fs: %r", describe, attempt, elapsed, exc,
                        extra={"retry_event": event},
                    )
                raise exc
            logger.info(
                "transient error on %s (attempt %d), retrying in %.2fs: %r", describe, attempt, delay, exc,
                extra={"retry_event": event},
            )
            yield delay  # the value of send(); the for loop's next() then starts the next attempt

    def _report(self, event: RetryEvent) -> None:
        if self.on_retry is None:
            return
        try:
            self.on_retry(event)
        except Exception:  # noqa: BLE001 - a reporter must not change what the call does
            logger.exception("the on_retry callback failed on %s", event.describe or "a retried call")

    def _delay(self, retry_index: int) -> float:
        cap = self.backoff_cap(retry_index)
        if not self.jitter:
            return cap
        return (self.rng or random).uniform(0.0, cap)


NO_RETRY = RetryPolicy(max_elapsed_secs=0.0, max_attempts=1)
"""Fail on the first error (tests, and operations whose caller retries at a higher level)."""
