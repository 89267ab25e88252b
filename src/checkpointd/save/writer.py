"""Background pipeline: serialize -> compress -> store every file, then manifest, then the commit marker.

One save is one :class:`SaveJob`. A single committer thread takes jobs in order (so commits happen in
step order), fans the job's files out to a thread pool (files are written in parallel; each file is
one stream: ``write_pt`` -> codec encoder -> checksum -> storage file), and only when every file is
durable writes ``manifest.json`` and then ``COMMITTED``. A failure at any point leaves the step
uncommitted; it is recorded on the job and re-raised on the training thread by the manager.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from checkpointd import commit
from checkpointd.format import layout
from checkpointd.storage import recycle
from checkpointd.codecs.checksum import ChecksumWriter, format_crc
from checkpointd.format.manifest import FileEntry, Manifest
from checkpointd.format.serialize import PtPlan, write_pt
from checkpointd.storage.serial_worker import SerialWorker
from checkpointd.storage.store import Store

logger = logging.getLogger("checkpointd")


@dataclass
class FileJob:
    """One file of a save: its plan (pickle + staged tensor storages) and format."""

    rel_path: str
    format: str
    plan: PtPlan
    dtypes: dict[str, Any]
    json_members: dict[str, bytes] | None = None
    rank: int = 0
    records: Any = None
    """Host budget: the ``chunkstream.FileRecords`` that deliver the bytes of the plan's placeholder records."""
    image: Any = None
    """Positional writes: the file's ``ptlayout.ZipImage``, laid out ahead (see ``BackgroundWriter.plan_job``)."""
    recycled: bool = False
    """Set by the write: the file was written over one taken from the recycling bin (retired, or blank
    made ahead), not created. Why kept: whether a save found its files is what decides its write speed
    on tmpfs (``stats()["last_save"]["files_recycled"]``)."""


@dataclass
class SaveJob:
    step: int
    step_dir: str
    files: list[FileJob]
    manifest: Manifest
    before_write: Callable[[], None]
    """Runs on the committer thread: waits for the snapshot copies, finishes deferred values (and plans
    the files if ``plan_files`` did not)."""
    after_files: Callable[[], None]
    """Runs once every file is written (success or not): frees the staging buffers."""
    commit_hook: Callable[[SaveJob], None] | None = None
    """Replaces the local commit (distributed runs coordinate it)."""
    after_commit: Callable[[SaveJob], None] | None = None
    stream: Any = None
    """Host budget: the ``chunkstream.ChunkStream`` that ``write_files`` runs while the files are written."""
    plan_files: Callable[[], None] | None = None
    """Runs first, before ``before_write`` waits for the copies: pickles the files into ``files`` when
    that needs no copied value (the Python work then overlaps the copy, not the training steps after it)."""
    plan_when: Callable[[float], bool] | None = None
    """Waits (at most the given seconds) until planning costs the training thread least: for a large CUDA
    snapshot, until its next optimizer step was reached (see ``snapshot.PendingCopies.training_waits``).
    None: plan at once."""
    fast: bool = False
    """Write every file at full speed (a preemption save, ``CHECKPOINTD_PERSIST=fast``), not gently."""
    future: Future = field(default_factory=Future)
    timings: dict[str, float] = field(default_factory=dict)
    written_bytes: int = 0
    raw_bytes: int = 0


class BackgroundWriter(SerialWorker):
    """Owns the committer thread (one save at a time, in order) and the file-writing pool."""

    def __init__(self, store: Store, codec: Any, file_threads: int = 4, retry: Any = None) -> None:
        super().__init__("checkpointd-committer")
        self.store = store
        self.codec = codec
        self.retry = retry if retry is not None else getattr(store, "retry", None)
        self._pool = ThreadPoolExecutor(max_workers=max(1, file_threads), thread_name_prefix="checkpointd-file")
        self.before_marker: Callable[[], None] | None = None
        """Run just before each commit marker is written (the root lease's check); may raise."""
        self._start()

    def submit(self, job: SaveJob) -> Future:
        with self._cv:
            if self._closed:
                raise RuntimeError("writer is closed")
            self._queue.append(job)
            self._cv.notify_all()
        return job.future

    def close(self) -> None:
        self._stop()
        self._pool.shutdown(wait=True)

    def _handle(self, job: SaveJob) -> None:
        try:
            with _short_gil_switch_interval():
                self._process(job)  # distributed runs override it: the pool is given back here, for both
            _release_restore_pool()
            job.future.set_result(job)
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the training thread
            job.future.set_exception(exc)

    def _process(self, job: SaveJob) -> None:
        try:
            self.plan_job(job)
            t0 = time.perf_counter()
            job.before_write()
        except BaseException:
            job.after_files()
            raise
        job.timings["stage_wait_secs"] = time.perf_counter() - t0
        error = self.write_files(job)
        if error is not None:
            raise error
        t2 = time.perf_counter()
        if job.commit_hook is not None:
            job.commit_hook(job)
        else:
            self._call(commit.write_manifest_and_commit, self.store, job.step_dir, job.manifest, self.before_marker)
        t3 = time.perf_counter()
        job.timings["commit_secs"] = t3 - t2
        if job.after_commit is not None:
            job.after_commit(job)
        job.timings["retention_secs"] = time.perf_counter() - t3

    def plan_job(self, job: SaveJob) -> None:
        """Pickle the files and lay out their zip images ahead of the copies, where the job allows it."""
        if job.plan_files is None:
            return
        wait = _env_seconds("CHECKPOINTD_PLAN_WAIT_SECS", PLAN_WAIT_SECS)
        plan_when = job.plan_when if wait > 0 and not job.fast else None  # a preemption save plans at once
        if plan_when is not None:
            t0 = time.perf_counter()
            plan_when(wait)
            job.timings["plan_wait_secs"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        with _short_gil_switch_interval(planning=True) if plan_when is not None else contextlib.nullcontext():
            job.plan_files()
            for fjob in job.files:
                if parallel_write_applies(self.store, self.codec, fjob):
                    fjob.image = file_image(fjob)
        job.timings["plan_secs"] = time.perf_counter() - t0

    def write_files(self, job: SaveJob) -> BaseException | None:
        """Write every file of ``job`` in parallel; returns the first failure (None if all succeeded).

        Waits for *every* file before freeing the staging buffers (``after_files``), also after a
        failure: a file still being written reads those buffers. Fills ``job.manifest.files``, the
        byte counts and ``write_secs``. Under a host budget this thread produces the chunk stream
        (device-to-host copies into free chunks) while the file threads consume it.
        """
        t1 = time.perf_counter()
        entries: list[FileEntry] = []
        error: BaseException | None = None
        stream = job.stream
        try:
            futures = [self._pool.submit(self._write_file_task, job.step_dir, f, stream, job.fast) for f in job.files]
            if stream is not None:
                try:
                    stream.produce()
                except BaseException as exc:  # noqa: BLE001 - the stream is aborted; wait for the files
                    error = exc
            for future in futures:
                try:
                    entries.append(future.result())
                except BaseException as exc:  # noqa: BLE001 - keep the first, wait for the rest
                    error = error or exc
            if stream is not None and stream.error is not None:
                error = stream.error  # the root cause, not a file that was aborted because of it
        finally:
            job.after_files()
        job.timings["write_secs"] = time.perf_counter() - t1
        job.manifest.files = entries
        job.written_bytes = sum(e.size for e in entries)
        job.raw_bytes = sum(e.raw_size or 0 for e in entries)
        return error

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self.retry is not None:
            return self.retry.call(fn, *args, describe=getattr(fn, "__name__", "storage call"))
        return fn(*args)

    def _write_file_task(self, step_dir: str, fjob: FileJob, stream: Any, fast: bool) -> FileEntry:
        """One file on a pool thread. Streamed files (host budget) get one attempt: their bytes are gone
        once written, so a failure aborts the stream (and the save) instead of retrying."""
        if fjob.records is None:
            return self._call(write_one_file, self.store, self.codec, step_dir, fjob, fast)
        try:
            return write_one_file(self.store, self.codec, step_dir, fjob, fast)
        except BaseException as exc:
            stream.abort(exc)
            raise


def _release_restore_pool() -> None:
    """Unpin a restore's bounce chunks once a save has committed (see :func:`checkpointd.restore.bulkcopy.release_pinned`).

    Here, not when the staging arena is pinned: a process that only restores (a benchmark, an
    evaluation job) keeps its pool, and a training run gives it back after its first checkpoint, on
    this thread (``cudaFreeHost`` waits for the device), leaving the arena as its pinned memory.
    """
    bulkcopy = sys.modules.get("checkpointd.restore.bulkcopy")
    if bulkcopy is not None:  # never imported: no restore pool to give back
        bulkcopy.release_pinned()


GIL_SWITCH_INTERVAL_SECS = 0.005
"""While a save is being written, Python's GIL switch interval is lowered to at most this.

The default equals Python's own (5 ms), so nothing changes unless ``CHECKPOINTD_GIL_SWITCH_INTERVAL_SECS``
asks for less. Session 2 lowered it to 0.5 ms, when the writer pickled and laid out files while the
training steps ran; that work now runs during the copy (``SaveJob.plan_files``), and the I/O threads
hold the GIL only between slices. Measured on an H200 (RESULTS.md, session 3): 0.45 GB state, 8
checkpoints each, stall 31.7 and 33.0 ms at 5 ms against 44.1 and 43.9 ms at 0.5 ms (session 2: 23.2
against 29.5); 4.83 GB, 62.7 against 64.7 ms. A short interval forces the training thread off the GIL
every time an I/O thread returns from a write."""

PLAN_GIL_SWITCH_INTERVAL_SECS = 0.0002
"""While the committer thread plans a deferred save (pickling, zip layout: 4-11 ms of Python on a 5 GB
state, see ``SaveJob.plan_when``), the switch interval is at most this
(``CHECKPOINTD_PLAN_SWITCH_INTERVAL_SECS``; 0 leaves it alone).

Why: deferred planning runs while the training thread waits for the GPU, without the GIL. When that
wait ends, the training thread would get the GIL back only after a full switch interval (5 ms by
default); with a short one, within ~0.2 ms. The planner's own CPU time is unchanged (more switches).
H200, 4.83 GB, same lease: the save step 8-13 -> 3-8 ms with both changes; this interval alone moved
the cost from the save step to the next one."""

PLAN_WAIT_SECS = 2.0
"""At most this long the committer waits for the training thread's next optimizer step before planning
(with no registered optimizer, or one that steps rarely, planning starts after it).
``CHECKPOINTD_PLAN_WAIT_SECS`` overrides it for benchmarks (0: plan at once, as before session 9)."""

_switch_lock = threading.Lock()
_switch_users = 0
_plan_users = 0
_switch_saved = 0.005


def _env_seconds(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


def _switch_interval() -> float:
    """``GIL_SWITCH_INTERVAL_SECS``, or ``CHECKPOINTD_GIL_SWITCH_INTERVAL_SECS`` (for benchmarks)."""
    value = _env_seconds("CHECKPOINTD_GIL_SWITCH_INTERVAL_SECS", GIL_SWITCH_INTERVAL_SECS)
    return value if value > 0 else GIL_SWITCH_INTERVAL_SECS


def _apply_switch_interval() -> None:
    """Set the interval the active writers and planners ask for (caller holds ``_switch_lock``)."""
    value = _switch_saved
    if _switch_users:
        value = min(value, _switch_interval())
    plan = _env_seconds("CHECKPOINTD_PLAN_SWITCH_INTERVAL_SECS", PLAN_GIL_SWITCH_INTERVAL_SECS)
    if _plan_users and plan > 0:
        value = min(value, plan)
    sys.setswitchinterval(value)


@contextlib.contextmanager
def _short_gil_switch_interval(planning: bool = False) -> Iterator[None]:
    """Lower the interpreter's switch interval while any writer is busy (``planning``: while any
    planner is, to ``PLAN_GIL_SWITCH_INTERVAL_SECS``); restore it after the last."""
    global _switch_users, _plan_users, _switch_saved
    with _switch_lock:
        if _switch_users == 0 and _plan_users == 0:
            _switch_saved = sys.getswitchinterval()
        if planning:
            _plan_users += 1
        else:
            _switch_users += 1
        _apply_switch_interval()
    try:
        yield
    finally:
        with _switch_lock:
            if planning:
                _plan_users -= 1
            else:
                _switch_users -= 1
            if _switch_users == 0 and _plan_users == 0:
                sys.setswitchinterval(_switch_saved)
            else:
                _apply_switch_interval()


class _CountingSink:
    """Counts native bytes passing to the encoder and forwards the dtype hint."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.nbytes = 0

    @property
    def dtype_hint(self) -> Any:
        return getattr(self.inner, "dtype_hint", None)

    @dtype_hint.setter
    def dtype_hint(self, value: Any) -> None:
        if hasattr(self.inner, "dtype_hint"):
            self.inner.dtype_hint = value

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        self.nbytes += n
        self.inner.write(data)
        return n


def write_one_file(store: Store, codec: Any, step_dir: str, fjob: FileJob, fast: bool = False) -> FileEntry:
    """Stream one file to storage; returns its manifest entry. Runs on a pool thread.

    ``fast``: write at full speed rather than gently beside training (``ptlayout.FAST_PERSIST_ENV``).

    A failed attempt discards the partial object (never visible as complete on object stores; an
    uncommitted partial local file is removed by retention or the next attempt).
    """
    rel = layout.join(step_dir, fjob.rel_path)
    if parallel_write_applies(store, codec, fjob):
        return _write_parallel(store, rel, codec, fjob, fast)
    raw = store.open_write(rel, expected_bytes=fjob.plan.data_nbytes)  # compressed: smaller
    try:
        checked = ChecksumWriter(raw)
        encoder = codec.encoder(checked)
        counting = _CountingSink(encoder)
        if fjob.records is not None:  # chunks are reused once passed on: a codec must be done reading them
            fjob.records.barrier = getattr(encoder, "drain", None)
        if fjob.format == "mdlus":
            from checkpointd.format.mdlus import write_mdlus

            write_mdlus(counting, fjob.json_members or {}, fjob.plan, fjob.dtypes, records=fjob.records)
        else:
            write_pt(fjob.plan, counting, fjob.dtypes, records=fjob.records)
        encoder.close()
        raw.close()
    except BaseException:
        _discard(raw)
        raise
    fjob.recycled = bool(getattr(raw, "recycled", False))
    return FileEntry(path=fjob.rel_path, size=checked.nbytes, checksum=checked.checksum, codec=codec.name,
                     format=fjob.format, rank=fjob.rank, raw_size=counting.nbytes)


PARALLEL_WRITE_ENV = "CHECKPOINTD_PARALLEL_WRITE"
"""Set to ``0`` to force the streaming writer everywhere (benchmarks compare the two)."""


def parallel_write_applies(store: Store, codec: Any, fjob: FileJob) -> bool:
    """Positional multi-threaded writes: local files, no codec (codecs parallelise compression already)."""
    return (
        getattr(store, "is_local", False)
        and getattr(codec, "name", None) == "none"
        and fjob.format in ("pt", "mdlus")
        and os.environ.get(PARALLEL_WRITE_ENV, "1") != "0"
    )


def _write_parallel(store: Store, rel: str, codec: Any, fjob: FileJob, fast: bool) -> FileEntry:
    """Lay the zip out in advance and write it with ``os.pwrite`` from the shared I/O pool.

    The manifest checksum (CRC-32 of the file as stored) is combined from the CRCs that the writing
    threads computed on each chunk; no byte is read twice. A failure removes the partial file.
    """
    from checkpointd.storage import ptlayout

    image = fjob.image if fjob.image is not None else file_image(fjob)
    fjob.image = None  # an image is written once (its pieces record CRCs); a retry lays it out again
    parent = rel.rsplit("/", 1)[0] if "/" in rel else ""
    store.makedirs(parent)
    result = ptlayout.write_file(store.path(rel), image, fill=fjob.records.fill if fjob.records is not None else None,
                                 fast=fast, recycle_from=recycle.bin_for(store), root=store.root)
    fjob.recycled = result.recycled
    return FileEntry(path=fjob.rel_path, size=result.nbytes, checksum=format_crc(result.crc), codec=codec.name,
                     format=fjob.format, rank=fjob.rank, raw_size=result.nbytes)


def file_image(fjob: FileJob) -> Any:
    """The zip image (every offset fixed) of a ``pt`` or ``mdlus`` file job, for positional writes."""
    from checkpointd.storage import ptlayout

    if fjob.format == "mdlus":
        return ptlayout.mdlus_image(fjob.json_members or {}, fjob.plan)
    return ptlayout.pt_image(fjob.plan)


def _discard(raw: Any) -> None:
    try:
        if hasattr(raw, "discard"):
            raw.discard()
        else:
            raw.close()
    except Exception:  # noqa: BLE001 - best effort; the step stays uncommitted either way
        pass
