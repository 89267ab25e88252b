"""What the command line prints: tables, JSON, one-line errors, sizes and times, a progress bar.

Human output goes to stdout; messages and the progress bar go to stderr (the bar only when stderr is
a terminal). :class:`Output` wraps stdout so that a reader that went away (``checkpointd ls | head``)
is told apart from a storage connection's broken pipe.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import sys
import time
from typing import Any, TextIO


class OutputClosed(Exception):
    """stdout's reader went away (``checkpointd ls | head -1``); a storage BrokenPipeError is not this."""


class Output:
    """stdout, telling a closed reader (:class:`OutputClosed`) from a storage connection's broken pipe."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError as exc:
            raise OutputClosed() from exc

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError as exc:
            raise OutputClosed() from exc

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def silence_stdout() -> None:
    """Point stdout, whose reader went away, at /dev/null: the interpreter's final flush stays quiet."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def one_line(exc: BaseException, with_type: bool = True, limit: int | None = 300) -> str:
    """``exc`` as one line (``limit``: at most that many characters of its message)."""
    text = " ".join(str(exc).split()) or repr(exc)
    if limit is not None and len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(exc).__name__}: {text}" if with_type else text


class Progress:
    """A one-line text progress bar on stderr, drawn only when stderr is a terminal."""

    def __init__(self, total: int, label: str, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = bool(getattr(self.stream, "isatty", lambda: False)()) and total > 0
        self.total, self.label, self.done = total, label, 0
        self._last = 0.0

    def update(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.monotonic()
        if self.enabled and (now - self._last > 0.1 or self.done >= self.total):
            self._last = now
            frac = min(1.0, self.done / self.total)
            bar = "#" * int(frac * 30)
            self.stream.write(f"\r{self.label[:40]:<40} [{bar:<30}] {frac:4.0%} "
                              f"{fmt_bytes(self.done)}/{fmt_bytes(self.total)}\x1b[K")
            self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.enabled and self._last:
            self.stream.write("\r\x1b[K")
            self.stream.flush()


def print_table(rows: list[list[str]], right: set[int] = frozenset(), indent: str = "") -> None:  # type: ignore[assignment]
    """``rows`` (the first is the header) in aligned columns; columns in ``right`` are right-aligned."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        print(indent + "  ".join(cells).rstrip())


def print_json(doc: Any) -> None:
    print(json.dumps(doc, indent=1, default=str))


def err(message: str) -> None:
    """``checkpointd: message`` on stderr."""
    print(f"checkpointd: {message}", file=sys.stderr, flush=True)


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"  # pragma: no cover


def fmt_time(ts: float | None) -> str:
    if ts is None:
        return "-"
    return _dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def fmt_age(secs: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if secs >= size:
            return f"{secs / size:.1f}{unit}"
    return f"{secs:.0f}s"


def fmt_metrics(metrics: dict[str, Any]) -> str:
    if not metrics:
        return "-"
    parts = []
    for k, v in metrics.items():
        parts.append(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}")
    return " ".join(parts)


__all__ = ["Output", "OutputClosed", "Progress", "err", "fmt_age", "fmt_bytes", "fmt_metrics", "fmt_time",
           "one_line", "print_json", "print_table", "silence_stdout"]
