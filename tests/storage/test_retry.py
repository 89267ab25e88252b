"""RetryPolicy and is_transient: what is retried, how long, and what surfaces."""

from __future__ import annotations

import asyncio
import errno
import logging
import random
import socket
from typing import Any

import pytest

from checkpointd.storage.retry import NO_RETRY, RetryEvent, RetryPolicy, is_transient


class FakeClock:
    """A clock that only moves when the policy sleeps."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, secs: float) -> None:
        self.sleeps.append(secs)
        self.now += secs


def make_policy(clock: FakeClock, **kwargs: Any) -> RetryPolicy:
    kwargs.setdefault("jitter", False)
    return RetryPolicy(clock=clock, sleep=clock.sleep, **kwargs)


class Flaky:
    """Raises the given errors in order, then returns "ok"."""

    def __init__(self, *errors: BaseException) -> None:
        self.errors = list(errors)
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "ok"


# -- duck-typed stand-ins for cloud SDK errors (no boto import) -------------------------------
class ClientError(Exception):
    def __init__(self, code: str, status: int) -> None:
        super().__init__(f"{code} ({status})")
        self.response = {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}


class EndpointConnectionError(Exception):
    pass


class ReadTimeoutError(Exception):
    pass


class ServerDisconnectedError(Exception):
    pass


class HttpError(Exception):  # gcsfs
    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def translated(outer: BaseException, cause: BaseException) -> BaseException:
    """What s3fs does: raise OSError(...) from the botocore error."""
    outer.__cause__ = cause
    return outer


@pytest.mark.parametrize(
    ("exc", "transient"),
    [
        (ConnectionResetError(errno.ECONNRESET, "reset"), True),
        (ConnectionRefusedError(), True),
        (BrokenPipeError(), True),
        (TimeoutError(), True),
        (socket.timeout(), True),
        (socket.gaierror(-3, "temporary failure in name resolution"), True),
        (OSError(errno.EAGAIN, "again"), True),
        (OSError(errno.EIO, "io"), True),
        (OSError(errno.ETIMEDOUT, "timed out"), True),
        (OSError(errno.EBUSY, "busy"), True),
        (OSError(errno.ENOSPC, "disk full"), False),
        (OSError(errno.EDQUOT, "quota"), False),
        (OSError(errno.EROFS, "read-only"), False),
        (OSError("no errno"), False),
        (FileNotFoundError(errno.ENOENT, "missing"), False),
        (PermissionError(errno.EACCES, "denied"), False),
        (IsADirectoryError(), False),
        (NotADirectoryError(), False),
        (FileExistsError(), False),
        (ValueError("bad"), False),
        (TypeError("bad"), False),
        (RuntimeError("unknown"), False),
        (KeyboardInterrupt(), False),
        (ClientError("SlowDown", 503), True),
        (ClientError("Throttling", 400), True),
        (ClientError("InternalError", 500), True),
        (ClientError("Whatever", 502), True),
        (ClientError("TooManyRequests", 429), True),
        (ClientError("NoSuchKey", 404), False),
        (ClientError("AccessDenied", 403), False),
        (ClientError("InvalidArgument", 400), False),
        (EndpointConnectionError(), True),
        (ReadTimeoutError(), True),
        (ServerDisconnectedError(), True),
        (HttpError(503), True),
        (HttpError(404), False),
        # s3fs translations: the cause decides when the outer error is generic ...
        (translated(OSError(errno.EIO, "x"), ClientError("Whatever", 400)), False),
        (translated(OSError("x"), EndpointConnectionError()), True),
        (translated(OSError(errno.EREMOTEIO, "x"), ClientError("InternalError", 500)), True),
        # ... but a permanent outer error wins over a transient-looking cause
        (translated(FileNotFoundError("gone"), ConnectionResetError()), False),
        (translated(OSError(errno.ENOSPC, "full"), TimeoutError()), False),
    ],
    ids=lambda v: repr(v)[:60] if isinstance(v, BaseException) else str(v),
)
def test_is_transient(exc: BaseException, transient: bool) -> None:
    assert is_transient(exc) is transient


@pytest.mark.parametrize(
    ("initial", "multiplier", "cap", "expected"),
    [
        (0.05, 2.0, 5.0, [0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0]),
        (1.0, 3.0, 10.0, [1.0, 3.0, 9.0, 10.0]),
        (0.5, 1.0, 5.0, [0.5, 0.5, 0.5]),
    ],
)
def test_backoff_cap_grows_geometrically_to_the_cap(
    initial: float, multiplier: float, cap: float, expected: list[float]
) -> None:
    policy = RetryPolicy(initial_backoff_secs=initial, multiplier=multiplier, max_backoff_secs=cap)
    assert [policy.backoff_cap(i) for i in range(len(expected))] == pytest.approx(expected)


def test_backoff_cap_does_not_overflow() -> None:
    assert RetryPolicy().backoff_cap(10_000) == 5.0


def test_recovers_from_transient_errors_with_exponential_sleeps() -> None:
    clock = FakeClock()
    fn = Flaky(ConnectionResetError(), TimeoutError(), OSError(errno.EAGAIN, "again"))
    assert make_policy(clock).call(fn, describe="op") == "ok"
    assert fn.calls == 4
    assert clock.sleeps == pytest.approx([0.05, 0.1, 0.2])


def test_passes_args_and_kwargs() -> None:
    seen = []
    RetryPolicy().call(lambda a, b=0: seen.append((a, b)), 1, b=2, describe="op")
    assert seen == [(1, 2)]


@pytest.mark.parametrize(
    "exc",
    [FileNotFoundError("x"), PermissionError("x"), OSError(errno.ENOSPC, "full"), IsADirectoryError("x"),
     ValueError("x"), OSError(errno.EDQUOT, "quota")],
    ids=type,
)
def test_permanent_errors_raise_at_once(exc: BaseException) -> None:
    clock = FakeClock()
    fn = Flaky(exc)
    with pytest.raises(type(exc)) as info:
        make_policy(clock).call(fn, describe="op")
    assert info.value is exc
    assert fn.calls == 1
    assert clock.sleeps == []


@pytest.mark.parametrize(
    ("max_elapsed", "expected_sleeps"),
    [
        (0.0, []),
        (0.1, [0.05]),
        (0.36, [0.05, 0.1, 0.2]),
        (1.0, [0.05, 0.1, 0.2, 0.4]),
    ],
)
def test_gives_up_within_the_time_budget_and_reraises_the_last_error(
    max_elapsed: float, expected_sleeps: list[float]
) -> None:
    clock = FakeClock()
    errors = [TimeoutError(f"attempt {i}") for i in range(100)]
    fn = Flaky(*errors)
    with pytest.raises(TimeoutError) as info:
        make_policy(clock, max_elapsed_secs=max_elapsed).call(fn, describe="write s3://b/x")
    assert clock.sleeps == pytest.approx(expected_sleeps)
    assert info.value is errors[len(expected_sleeps)]
    assert clock.now <= max_elapsed
    if expected_sleeps:
        assert any("gave up on write s3://b/x" in note for note in info.value.__notes__)


def test_max_attempts_bounds_attempts() -> None:
    clock = FakeClock()
    fn = Flaky(*[ConnectionResetError() for _ in range(10)])
    with pytest.raises(ConnectionResetError):
        make_policy(clock, max_attempts=3).call(fn, describe="op")
    assert fn.calls == 3


def test_no_retry_fails_on_first_error() -> None:
    fn = Flaky(ConnectionResetError())
    with pytest.raises(ConnectionResetError):
        NO_RETRY.call(fn, describe="op")
    assert fn.calls == 1


def test_full_jitter_stays_within_the_cap() -> None:
    clock = FakeClock()
    policy = make_policy(clock, jitter=True, rng=random.Random(0), max_elapsed_secs=1e9, max_attempts=12)
    with pytest.raises(ConnectionResetError):
        policy.call(Flaky(*[ConnectionResetError() for _ in range(20)]), describe="op")
    assert len(clock.sleeps) == 11
    for i, slept in enumerate(clock.sleeps):
        assert 0.0 <= slept <= policy.backoff_cap(i)
    assert len(set(clock.sleeps)) == len(clock.sleeps)  # really random


def test_custom_is_transient() -> None:
    clock = FakeClock()
    fn = Flaky(KeyError("retry me"))
    assert make_policy(clock, is_transient=lambda e: isinstance(e, KeyError)).call(fn, describe="op") == "ok"


def test_logs_retries_lazily(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    with caplog.at_level(logging.INFO, logger="checkpointd"):
        make_policy(clock).call(Flaky(ConnectionResetError("boom")), describe="read s3://b/k")
    record = next(r for r in caplog.records if "transient error" in r.getMessage())
    assert record.args and "read s3://b/k" in record.getMessage()


def test_call_async_retries_like_call() -> None:
    attempts = []

    async def flaky() -> str:
        attempts.append(1)
        if len(attempts) < 3:
            raise ConnectionResetError()
        return "ok"

    policy = RetryPolicy(initial_backoff_secs=0.001, max_backoff_secs=0.002)
    assert asyncio.run(policy.call_async(flaky, describe="op")) == "ok"
    assert len(attempts) == 3


def test_call_async_permanent_error() -> None:
    async def denied() -> None:
        raise PermissionError("no")

    with pytest.raises(PermissionError):
        asyncio.run(RetryPolicy().call_async(denied, describe="op"))


@pytest.mark.parametrize(
    "kwargs",
    [{"max_elapsed_secs": -1}, {"initial_backoff_secs": -1}, {"multiplier": 0.5}, {"max_attempts": 0}],
)
def test_invalid_policies_raise(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        RetryPolicy(**kwargs)


def test_policy_is_frozen_and_keyword_only() -> None:
    policy = RetryPolicy()
    with pytest.raises(AttributeError):
        policy.max_elapsed_secs = 1.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        RetryPolicy(1.0)  # type: ignore[misc]


# -- on_retry: who waits is told ---------------------------------------------------------------------
def test_on_retry_reports_each_transient_failure_then_giving_up() -> None:
    clock = FakeClock()
    events: list[RetryEvent] = []
    errors = [TimeoutError(f"attempt {i}") for i in range(10)]
    policy = make_policy(clock, max_elapsed_secs=0.36, on_retry=events.append)
    with pytest.raises(TimeoutError) as info:
        policy.call(Flaky(*errors), describe="list s3://b/r")
    assert info.value is errors[3]
    assert [(e.attempt, e.giving_up) for e in events] == [(1, False), (2, False), (3, False), (4, True)]
    assert [e.error for e in events] == errors[:4]
    assert [e.delay_secs for e in events] == pytest.approx([0.05, 0.1, 0.2, 0.0])
    assert [e.elapsed_secs for e in events] == pytest.approx([0.0, 0.05, 0.15, 0.35])
    assert [e.remaining_secs for e in events] == pytest.approx([0.36, 0.31, 0.21, 0.0])
    assert {(e.describe, e.budget_secs) for e in events} == {("list s3://b/r", 0.36)}


def test_on_retry_is_quiet_on_success_and_permanent_errors() -> None:
    events: list[RetryEvent] = []
    policy = make_policy(FakeClock(), on_retry=events.append)
    assert policy.call(Flaky(), describe="op") == "ok"
    with pytest.raises(PermissionError):
        policy.call(Flaky(PermissionError("denied")), describe="op")
    assert events == []
    assert policy.call(Flaky(ConnectionResetError("blip")), describe="op") == "ok"
    assert [(e.attempt, e.giving_up) for e in events] == [(1, False)]


def test_on_retry_giving_up_on_the_first_attempt_is_reported() -> None:
    events: list[RetryEvent] = []
    with pytest.raises(ConnectionResetError):
        make_policy(FakeClock(), max_attempts=1, on_retry=events.append).call(Flaky(ConnectionResetError()), describe="op")
    assert [(e.attempt, e.giving_up, e.delay_secs) for e in events] == [(1, True, 0.0)]


def test_a_failing_on_retry_changes_nothing(caplog: pytest.LogCaptureFixture) -> None:
    def broken(event: RetryEvent) -> None:
        raise RuntimeError("reporter bug")

    fn = Flaky(ConnectionResetError(), ConnectionResetError())
    with caplog.at_level(logging.ERROR, logger="checkpointd"):
        assert make_policy(FakeClock(), on_retry=broken).call(fn, describe="read s3://b/k") == "ok"
    assert fn.calls == 3
    assert any("on_retry callback failed on read s3://b/k" in r.getMessage() for r in caplog.records)


def test_on_retry_async_and_log_records_carry_the_event(caplog: pytest.LogCaptureFixture) -> None:
    events: list[RetryEvent] = []
    attempts = []

    async def flaky() -> str:
        attempts.append(1)
        if len(attempts) < 3:
            raise ConnectionResetError()
        return "ok"

    policy = RetryPolicy(initial_backoff_secs=0.001, max_backoff_secs=0.002, on_retry=events.append)
    with caplog.at_level(logging.INFO, logger="checkpointd"):
        assert asyncio.run(policy.call_async(flaky, describe="op")) == "ok"
    assert [e.attempt for e in events] == [1, 2]
    assert [r.retry_event for r in caplog.records if hasattr(r, "retry_event")] == events


def test_on_retry_does_not_change_equality() -> None:
    assert RetryPolicy(on_retry=print) == RetryPolicy()
