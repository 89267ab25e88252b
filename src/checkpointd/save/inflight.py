"""Saves in flight: the jobs the training thread started and has not collected yet.

The manager starts a save, the committer thread finishes it (``future`` resolves), and the training
thread collects it here at its next ``maybe_save``/``wait``/``close``/``stats``: successes update the
counters, failures queue up to be raised there as ``CheckpointWriteError`` (SPEC §2: a background
failure surfaces on the training thread, once). Thread-safe: the committer thread reads the set of
in-flight steps to keep retention away from them.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from checkpointd.errors import CheckpointTimeoutError
from checkpointd.save.job import SaveJob


@dataclass
class SaveCounters:
    saves_started: int = 0
    saves_committed: int = 0
    saves_failed: int = 0
    snapshot_secs_total: float = 0.0
    snapshot_secs_last: float = 0.0
    bytes_written_total: int = 0
    raw_bytes_total: int = 0


class InFlight:
    """Started saves, oldest first, with the failures and counters they leave behind."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: deque[SaveJob] = deque()
        self._steps: set[int] = set()
        self._failures: list[tuple[SaveJob, BaseException]] = []
        self.counters = SaveCounters()
        self.last_committed_job: SaveJob | None = None

    def __len__(self) -> int:
        return len(self._jobs)

    def writing(self) -> bool:
        """True while a started save has not finished (safe from any thread; what blank files made
        ahead wait for, so that they do not compete with a save's writes)."""
        with self._lock:
            return any(not job.future.done() for job in self._jobs)

    def steps(self) -> set[int]:
        """Steps started and not collected (a copy: safe from any thread)."""
        with self._lock:
            return set(self._steps)

    def add(self, job: SaveJob, snapshot_secs: float) -> None:
        c = self.counters
        c.snapshot_secs_last = snapshot_secs
        c.snapshot_secs_total += snapshot_secs
        c.saves_started += 1
        with self._lock:
            self._jobs.append(job)
            self._steps.add(job.step)

    def oldest(self) -> SaveJob | None:
        with self._lock:
            return self._jobs[0] if self._jobs else None

    def wait_for(self, job: SaveJob, timeout: float | None) -> None:
        """Block until ``job`` finished (success or failure), then collect what finished.

        Raises:
            CheckpointTimeoutError: ``timeout`` passed first.
        """
        try:
            job.future.result(timeout=timeout)
        except FutureTimeout as exc:
            raise CheckpointTimeoutError(
                f"the save of step {job.step} was still running after {timeout:.3g} s; call wait() again or raise the timeout"
            ) from exc
        except BaseException:  # noqa: BLE001 - collected (and raised later) by collect()
            pass
        self.collect()

    def collect(self) -> None:
        """Move finished jobs out, oldest first, counting successes and queueing failures."""
        with self._lock:
            while self._jobs and self._jobs[0].future.done():
                job = self._jobs.popleft()
                self._steps.discard(job.step)
                exc = job.future.exception()
                if exc is None:
                    self.counters.saves_committed += 1
                    self.counters.bytes_written_total += job.written_bytes
                    self.counters.raw_bytes_total += job.raw_bytes
                    self.last_committed_job = job
                else:
                    self.counters.saves_failed += 1
                    self._failures.append((job, exc))

    def pop_failure(self) -> tuple[SaveJob, BaseException] | None:
        self.collect()
        with self._lock:
            return self._failures.pop(0) if self._failures else None

    def stats(self) -> dict[str, Any]:
        self.collect()
        c = self.counters
        out: dict[str, Any] = {
            "saves_started": c.saves_started,
            "saves_committed": c.saves_committed,
            "saves_failed": c.saves_failed,
            "saves_pending": len(self._jobs),
            "snapshot_secs_last": c.snapshot_secs_last,
            "snapshot_secs_total": c.snapshot_secs_total,
            "bytes_written_total": c.bytes_written_total,
            "raw_bytes_total": c.raw_bytes_total,
            "compression_ratio": (c.raw_bytes_total / c.bytes_written_total) if c.bytes_written_total else None,
        }
        last = self.last_committed_job
        if last is not None:
            out["last_save"] = {"step": last.step, **last.timings, "bytes_written": last.written_bytes,
                                "raw_bytes": last.raw_bytes, "files": len(last.files),
                                "files_recycled": sum(1 for f in last.files if f.recycled)}
        return out
