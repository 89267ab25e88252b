"""Uncommitted leftovers: find them, age them, remove them (``checkpointd gc``).

A step directory without a ``COMMITTED`` marker is either a save in flight or the remains of a crashed
one; nothing tells the two apart but time. :func:`collect_garbage` therefore removes only leftovers
whose *newest* file is older than a grace period (default one hour, SPEC §2), judged by the storage's
modification times, and re-checks the marker just before removing, so it is safe beside a running
writer whose files are younger than the grace period. Committed directories are never touched, even
damaged ones: that is for a person to decide after ``checkpointd verify``.

Nothing removed lies outside the root, whatever links the root holds: a step-shaped entry that is a
symbolic link is an uncommitted leftover of its own, aged by the link's own time and removed as a link
(never its target, never descended into); links inside a leftover are removed as links
(:meth:`checkpointd.storage.store.Store.remove_tree`).
"""

from __future__ import annotations

import datetime as _dt
import re
import time
from dataclasses import asdict, dataclass
from typing import Any

from checkpointd import commit
from checkpointd.errors import ConfigError
from checkpointd.storage.store import Store

__all__ = ["DEFAULT_GRACE_SECS", "DirScan", "GcResult", "collect_garbage", "parse_duration", "scan_dir"]

DEFAULT_GRACE_SECS = 3600.0
"""``checkpointd gc --older-than`` default: one hour."""

_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$", re.IGNORECASE)


@dataclass
class DirScan:
    """What one step directory holds, from a listing (no file is read)."""

    files: int
    nbytes: int
    newest_mtime: float | None
    """Newest modification time of its files (or of the directory when empty); None if unknown."""


@dataclass
class GcResult:
    step: int
    path: str
    age_secs: float | None
    action: str
    """``removed``, ``would remove`` (dry run), ``kept (younger than ...)``, ``kept (age unknown)``,
    ``skipped (committed meanwhile)`` or ``failed: ...``."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_duration(text: str) -> float:
    """Seconds from ``"3600"``, ``"90s"``, ``"30m"``, ``"1h"``, ``"2d"``.

    Raises:
        ConfigError: anything else.
    """
    match = _DURATION_RE.match(str(text))
    if not match:
        raise ConfigError(f"cannot read duration {text!r}; use seconds or a number with s, m, h or d (e.g. 90, 30m, 1h)")
    return float(match.group(1)) * _UNITS[match.group(2).lower()]


def scan_dir(store: Store, rel: str) -> DirScan:
    """File count, stored bytes and newest modification time of everything under ``rel`` (a link: none,
    and the link's own time; nothing behind it is looked at)."""
    full = store.path(rel)
    if store.is_link(rel):
        return DirScan(files=0, nbytes=0, newest_mtime=store._lstat(rel).st_mtime)
    if not store.is_local:
        store.fs.invalidate_cache(full)
    found = store.fs.find(full, detail=True)
    files = [info for info in found.values() if info.get("type", "file") == "file"]
    times = [t for t in (mtime_of(info) for info in files) if t is not None]
    if not files:
        try:
            t = mtime_of(store.fs.info(full))
            times = [t] if t is not None else []
        except (FileNotFoundError, NotADirectoryError):
            pass
    return DirScan(files=len(files), nbytes=sum(int(i.get("size") or 0) for i in files), newest_mtime=max(times) if times else None)


def mtime_of(info: dict[str, Any]) -> float | None:
    """A POSIX timestamp from an fsspec ``info`` dict, whatever the backend calls it."""
    for key in ("mtime", "LastModified", "last_modified", "updated", "modified", "created", "mtime_ns"):
        value = info.get(key)
        if value is None:
            continue
        if key == "mtime_ns":
            return float(value) / 1e9
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, _dt.datetime):
            return (value if value.tzinfo else value.replace(tzinfo=_dt.timezone.utc)).timestamp()
        if isinstance(value, str):
            try:
                parsed = _dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
            except ValueError:
                continue
            return (parsed if parsed.tzinfo else parsed.replace(tzinfo=_dt.timezone.utc)).timestamp()
    return None


def collect_garbage(store: Store, *, older_than_secs: float = DEFAULT_GRACE_SECS, dry_run: bool = False,
                    now: float | None = None) -> list[GcResult]:
    """Remove uncommitted step directories whose newest file is older than ``older_than_secs``.

    Returns one result per uncommitted directory, ascending by step. A directory whose age cannot be
    told (a backend without modification times) is kept unless ``older_than_secs`` is 0.
    """
    if older_than_secs < 0:
        raise ConfigError(f"older_than_secs must be >= 0, got {older_than_secs}")
    now = time.time() if now is None else now
    committed = set(commit.committed_steps(store))
    results = []
    for step, name in sorted(commit.list_step_dirs(store).items()):
        if step in committed:
            continue
        scan = scan_dir(store, name)
        age = None if scan.newest_mtime is None else max(0.0, now - scan.newest_mtime)
        result = GcResult(step=step, path=store.display(name), age_secs=age, action="")
        if age is None and older_than_secs > 0:
            result.action = "kept (age unknown)"
        elif age is not None and age < older_than_secs:
            result.action = f"kept (younger than {human_secs(older_than_secs)})"
        elif dry_run:
            result.action = "would remove"
        elif commit.is_committed(store, name):  # a writer committed it since the listing
            result.action = "skipped (committed meanwhile)"
        else:
            try:
                store.remove_tree(name)
                result.action = "removed"
            except OSError as exc:
                result.action = f"failed: {exc}"
        results.append(result)
    return results


def human_secs(secs: float) -> str:
    """``3600`` -> ``1h``; ``90`` -> ``90s``."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if secs >= size and secs % size == 0:
            return f"{int(secs // size)}{unit}"
    return f"{secs:g}s"
