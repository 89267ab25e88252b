"""Two tiers: commit on local disk first, upload to the remote root in the background.

``CheckpointManager(root="s3://b/run", local_dir="/scratch/run")`` writes and commits every save on
``local_dir`` (fast, and resumable on the same node), then :class:`Uploader` copies each committed step
to ``root`` on its own thread, with the same marker-last rule as every save: the data files (each
checked against the manifest's checksum on the way, so a damaged local copy is never published),
then ``manifest.json``, then ``COMMITTED`` with the very bytes of the local marker. Retention runs on
both tiers; a step waiting for its upload is never deleted locally. ``restore_latest`` takes the
newest step committed on either tier, from a verified local copy when there is one, else remote.

Failures: an upload is retried like any storage call (``IOOptions.retry_timeout_secs``); once given up, the next
``maybe_save``/``wait``/``close`` raises ``CheckpointWriteError`` for that step (its local copy stays
committed). Backpressure: ``maybe_save`` waits while more than ``max_pending`` committed steps are
still waiting for their upload, so a slow remote bounds local disk use instead of growing a queue.

Limits: single-process runs only (distributed runs write to ``root`` directly). A crash between the
local commit and the upload leaves that step local only; the next manager on the same ``local_dir``
uploads local steps newer than the remote's newest at startup.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from checkpointd import commit
from checkpointd.format import layout
from checkpointd.codecs.checksum import ChecksumWriter
from checkpointd.errors import NOT_VERIFIED, CheckpointTimeoutError, CorruptCheckpointError
from checkpointd.retention import MetricsCache, apply_retention
from checkpointd.format.manifest import FileEntry
from checkpointd.policy import RetentionPolicy
from checkpointd.storage.serial_worker import SerialWorker
from checkpointd.storage.store import Store

__all__ = ["Uploader", "restore_latest_two_tier"]

logger = logging.getLogger("checkpointd")

COPY_CHUNK_BYTES = 8 * 2**20




class Uploader(SerialWorker):
    """Copies committed local steps to the remote root, one step at a time, on a background thread.

    Args:
        local, remote: the two tiers' stores.
        retention: the manager's retention policy, applied to the remote after each upload.
        file_threads: files of one step copied in parallel.
        on_uploaded: called with the step after each upload attempt, before ``wait`` can return.

    ``submit`` is called on the committer thread; ``wait``/``pop_failure``/``wait_backlog`` on the
    training thread.
    """

    def __init__(self, local: Store, remote: Store, retention: RetentionPolicy, file_threads: int = 4,
                 on_uploaded: Callable[[int], None] | None = None) -> None:
        self.local = local
        self.on_uploaded = on_uploaded
        """Called on the uploader thread after each upload (and remote retention): local retention."""
        self.remote = remote
        self.retention = retention
        super().__init__("checkpointd-uploader")
        self._pool = ThreadPoolExecutor(max_workers=max(1, file_threads), thread_name_prefix="checkpointd-upload")
        self._active: int | None = None
        self._busy = False
        self._failures: list[tuple[int, BaseException]] = []
        self._metrics = MetricsCache(remote)
        self.before_marker: Callable[[], None] | None = None
        """Run just before each remote commit marker is written (the remote root's lease check); may raise."""
        self.uploaded: list[int] = []
        """Steps uploaded by this uploader, in order."""
        self._start()

    # -- training/committer thread API ---------------------------------------------------------
    def submit(self, step: int) -> None:
        with self._cv:
            if step not in self._queue and step != self._active:
                self._queue.append(step)
            self._cv.notify_all()

    def resume_pending(self, before_first: Callable[[], None] | None = None) -> list[int]:
        """Queue local committed steps newer than the remote's newest (a crash before their upload).

        ``before_first()`` runs once before anything is queued (taking the roots' leases), if anything is.
        """
        local_steps = commit.committed_steps(self.local)
        remote_steps = commit.committed_steps(self.remote)
        newest_remote = remote_steps[-1] if remote_steps else -1
        todo = [s for s in local_steps if s > newest_remote]
        if todo and before_first is not None:
            before_first()
        for s in todo:
            logger.info("checkpointd: step %d is committed locally but not uploaded; uploading it", s)
            self.submit(s)
        return todo

    def pending_steps(self) -> set[int]:
        """Steps queued or uploading: local retention must keep them."""
        with self._cv:
            out = set(self._queue)
            if self._active is not None:
                out.add(self._active)
            return out

    def backlog(self) -> int:
        with self._cv:
            return len(self._queue) + self._busy

    def wait_backlog(self, max_backlog: int) -> None:
        """Block until at most ``max_backlog`` steps wait for their upload."""
        with self._cv:
            while len(self._queue) + self._busy > max_backlog:
                self._cv.wait()

    def wait(self, timeout: float | None = None) -> None:
        """Block until every submitted step is uploaded (or failed).

        Raises:
            CheckpointTimeoutError: ``timeout`` ran out first.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._queue or self._busy:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise CheckpointTimeoutError(
                        f"the upload of step {self._active} to {self.remote.display()} was still running after "
                        f"{timeout:.3g} s; call wait() again or raise the timeout"
                    )
                self._cv.wait(remaining)

    def pop_failure(self) -> tuple[int, BaseException] | None:
        with self._cv:
            return self._failures.pop(0) if self._failures else None

    def close(self) -> None:
        self._stop()
        self._pool.shutdown(wait=True)

    # -- uploader thread -------------------------------------------------------------------------
    def _took(self, step: int) -> None:
        self._active = step
        self._busy = True

    def _handle(self, step: int) -> None:
        try:
            self._upload_and_retain(step)
        finally:
            with self._cv:
                self._busy = False
                self._cv.notify_all()

    def _upload_and_retain(self, step: int) -> None:
        try:
            self.upload(step)
            self.uploaded.append(step)
        except BaseException as exc:  # noqa: BLE001 - reported on the training thread
            logger.warning("checkpointd: upload of step %d to %s failed: %r", step, self.remote.display(), exc)
            with self._cv:
                self._failures.append((step, exc))
        try:
            self._apply_remote_retention(step)
        except Exception as exc:  # noqa: BLE001 - retention failing must not fail an upload
            logger.warning("checkpointd: remote retention after step %d failed: %s", step, exc)
        with self._cv:
            self._active = None  # no longer pending: local retention may delete it now
        if self.on_uploaded is not None:
            try:
                self.on_uploaded(step)
            except Exception as exc:  # noqa: BLE001
                logger.warning("checkpointd: local retention after uploading step %d failed: %s", step, exc)

    def upload(self, step: int) -> None:
        """Copy one committed local step to the remote: data files, manifest, then the marker."""
        step_dir = layout.step_dir_name(step)
        manifest = commit.read_committed_manifest(self.local, step_dir)  # raises if the local copy is not committed
        manifest_bytes = self.local.read_bytes(layout.join(step_dir, layout.MANIFEST_NAME))
        marker_bytes = self.local.read_bytes(layout.join(step_dir, layout.COMMIT_MARKER_NAME))
        self._metrics.record(step, manifest.metrics)
        if commit.is_committed(self.remote, step_dir):
            if self.remote.read_bytes(layout.join(step_dir, layout.COMMIT_MARKER_NAME)) == marker_bytes:
                return  # uploaded before (a restart); the marker names the same manifest checksum
        if self.remote.exists(step_dir) or self.remote.list_dir(step_dir):
            commit.uncommit_and_remove(self.remote, step_dir)  # a leftover, or an older save of this step
        futures = [self._pool.submit(self._copy_file, step_dir, entry) for entry in manifest.files]
        for f in futures:
            f.result()  # re-raises the first failure; the step stays uncommitted remotely
        # IMPORTANT: the same order as a save: every data file is durable before the manifest, the marker last.
        self.remote.write_bytes(layout.join(step_dir, layout.MANIFEST_NAME), manifest_bytes)
        if self.before_marker is not None:
            self.before_marker()
        self.remote.write_bytes(layout.join(step_dir, layout.COMMIT_MARKER_NAME), marker_bytes)

    def _copy_file(self, step_dir: str, entry: FileEntry) -> None:
        self.remote.retry.call(self._copy_file_once, step_dir, entry,
                               describe=f"upload {self.remote.display(layout.join(step_dir, entry.path))}")

    def _copy_file_once(self, step_dir: str, entry: FileEntry) -> None:
        rel = layout.join(step_dir, entry.path)
        out = self.remote.open_write(rel)
        try:
            checked = ChecksumWriter(out)
            with self.local.open_read(rel) as src:
                while chunk := src.read(COPY_CHUNK_BYTES):
                    checked.write(chunk)
            if checked.nbytes != entry.size or checked.checksum != entry.checksum:
                raise CorruptCheckpointError(
                    f"{self.local.display(rel)} does not match its manifest ({checked.nbytes} bytes, checksum "
                    f"{checked.checksum}; expected {entry.size}, {entry.checksum}); not uploading a damaged checkpoint"
                )
            out.close()
        except BaseException:
            out.abort()
            raise

    def _apply_remote_retention(self, just_uploaded: int) -> None:
        apply_retention(self.remote, self.retention, just_uploaded, self.pending_steps() - {just_uploaded}, self._metrics)


def restore_latest_two_tier(local: Store, remote: Store, restore_from: Callable[[int, Store], None],
                            quarantine: Callable[[list[tuple[Store, int, BaseException]]], None]) -> int | None:
    """Restore the newest step committed on either tier: the local copy if it verifies, else the remote.

    A copy that fails verification is skipped with a warning; once a copy restored, the ones that
    failed are taken out of their tier's checkpoints (``quarantine``).

    Raises:
        CorruptCheckpointError: committed steps exist but no copy of any of them verifies.
    """
    local_steps = set(commit.marked_steps(local))
    remote_steps = set(commit.marked_steps(remote))
    steps = sorted(local_steps | remote_steps, reverse=True)
    if not steps:
        return None
    failures: list[str] = []
    damaged: list[tuple[Store, int, BaseException]] = []
    for step in steps:
        copies = [s for s, has in ((local, step in local_steps), (remote, step in remote_steps)) if has]
        for store in copies:
            try:
                restore_from(step, store)
            except NOT_VERIFIED as exc:
                warnings.warn(f"checkpointd: skipping step {step} at {store.display()}, it does not verify: {exc}",
                              RuntimeWarning, stacklevel=4)
                failures.append(f"step {step} at {store.display()}: {exc}")
                damaged.append((store, step, exc))
                continue
            quarantine(damaged)
            return step
    raise CorruptCheckpointError(
        f"{local.display()} and {remote.display()} hold {len(steps)} committed step(s) but no copy verifies: "
        + "; ".join(failures[:5])
    )
