"""Background pipeline: serialize -> compress -> store every file, then manifest, then the commit marker.

One save is one :class:`~checkpointd.save.job.SaveJob` (data). A single committer thread takes jobs
in order (so commits happen in step order) and runs :meth:`BackgroundWriter._process` on each: the
planning steps of ``planning.py`` (plan ahead, wait for the copies, plan the rest), then it fans the
job's files out to a thread pool (files are written in parallel; each file is one stream:
``write_pt`` -> codec encoder -> checksum -> storage file), gives the staging buffers back, and only
when every file is durable writes ``manifest.json`` and then ``COMMITTED`` (``commit.py``), then runs
the writer's ``on_commit`` hook. A failure at any point leaves the step uncommitted; it is recorded on
the job's future and re-raised on the training thread by the manager.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from checkpointd.storage import recyclebin
from checkpointd.storage import ziplayout
from checkpointd import commit
from checkpointd.format import layout
from checkpointd.storage import ptlayout
from checkpointd.codecs.checksum import ChecksumWriter, format_crc
from checkpointd.codecs.compress import plane_itemsize
from checkpointd.format.manifest import FileEntry
from checkpointd.format.mdlus import write_mdlus
from checkpointd.format.serialize import write_pt
from checkpointd.save import device_encode, planning
from checkpointd.save.job import FileJob, SaveJob
from checkpointd.storage.serial_worker import SerialWorker
from checkpointd.storage.store import Store

logger = logging.getLogger("checkpointd")


class BackgroundWriter(SerialWorker):
    """Owns the committer thread (one save at a time, in order) and the file-writing pool."""

    def __init__(self, store: Store, codec: Any, file_threads: int = 4, retry: Any = None, *,
                 clear_step_dir: Callable[[str], None] | None = None,
                 on_commit: Callable[[SaveJob], None] | None = None,
                 after_save: Callable[[], None] | None = None) -> None:
        super().__init__("checkpointd-committer")
        self.store = store
        self.codec = codec
        self.retry = retry if retry is not None else getattr(store, "retry", None)
        self._pool = ThreadPoolExecutor(max_workers=max(1, file_threads), thread_name_prefix="checkpointd-file")
        self.before_marker: Callable[[], None] | None = None
        """Run just before each commit marker is written (the root lease's check); may raise."""
        self.clear_step_dir = clear_step_dir
        """Run with the step directory once the copies landed, before any file is written (removes an
        uncommitted leftover of the same step)."""
        self.on_commit = on_commit
        """Run with each committed job (the manager records the commit, queues its upload, applies retention)."""
        self.after_save = after_save
        """Run after each committed save, on this thread (the manager gives a restore's pinned bounce
        chunks back here: ``cudaFreeHost`` waits for the device)."""
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
            self._process(job)  # distributed runs override it: ``after_save`` runs here, for both
            if self.after_save is not None:
                self.after_save()
            job.future.set_result(job)
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the training thread
            job.future.set_exception(exc)

    def stage(self, job: SaveJob) -> None:
        """A job's failure raised, else its files planned ahead and its copies waited for (the wait goes
        into ``job.timings["stage_wait_secs"]``)."""
        if job.failure is not None:
            raise job.failure
        self.plan_job(job)
        t0 = time.perf_counter()
        try:
            self.prepare_files(job)
        finally:
            job.timings["stage_wait_secs"] = time.perf_counter() - t0

    def _process(self, job: SaveJob) -> None:
        """One save: plan ahead, wait for the copies, plan the rest, write the files, then commit."""
        try:
            self.stage(job)
        except BaseException:
            planning.release_staging(job)
            raise
        error = self.write_files(job)
        if error is not None:
            raise error
        t2 = time.perf_counter()
        self._call(commit.write_manifest_and_commit, self.store, job.step_dir, job.manifest, self.before_marker)
        t3 = time.perf_counter()
        job.timings["commit_secs"] = t3 - t2
        if self.on_commit is not None:
            self.on_commit(job)
        job.timings["retention_secs"] = time.perf_counter() - t3

    def plan_job(self, job: SaveJob) -> None:
        """Pickle the files and lay out their zip images ahead of the copies, where the job allows it
        (:func:`planning.plans_ahead`); a large CUDA snapshot first waits for the training thread's next
        optimizer step (:func:`planning.training_waits`), at most :data:`PLAN_WAIT_SECS`."""
        if not planning.plans_ahead(job):
            return
        wait = PLAN_WAIT_SECS
        waits = planning.training_waits(job) if wait > 0 and not job.fast else None  # a preemption save plans at once
        if waits is not None:
            t0 = time.perf_counter()
            waits.wait(wait)
            job.timings["plan_wait_secs"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        if planning.plan_files(job, copied=False):
            for fjob in job.files:
                if parallel_write_applies(self.store, self.codec, fjob):
                    fjob.image = file_image(fjob)
        job.timings["plan_secs"] = time.perf_counter() - t0

    def prepare_files(self, job: SaveJob) -> None:
        """Wait for the snapshot's copies, clear the step directory (``clear_step_dir``), plan what is left."""
        planning.wait_for_copies(job)
        device_encode.encode_staged(job, self.codec)
        if self.clear_step_dir is not None:
            self.clear_step_dir(job.step_dir)
        if job.streamed:
            planning.plan_stream(job)
        else:
            planning.plan_files(job)
        for fjob in job.files:
            fjob.encoded = job.encoded or None

    def write_files(self, job: SaveJob) -> BaseException | None:
        """Write every file of ``job`` in parallel; returns the first failure (None if all succeeded).

        Waits for *every* file before freeing the staging buffers (:func:`planning.release_staging`), also after a
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
            planning.release_staging(job)
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


PLAN_WAIT_SECS = 2.0
"""At most this long the committer waits for the training thread's next optimizer step before planning
a deferred save (with no registered optimizer, or one that steps rarely, planning starts after it)."""


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

    ``fast``: write at full speed rather than gently beside training (``checkpointd.storage.writemode.FAST_PERSIST``).

    A failed attempt discards the partial object (never visible as complete on object stores; an
    uncommitted partial local file is removed by retention or the next attempt).
    """
    rel = layout.join(step_dir, fjob.rel_path)
    if parallel_write_applies(store, codec, fjob):
        return _write_parallel(store, rel, codec, fjob, fast)
    if encoded_write_applies(store, codec, fjob):
        entry = _write_encoded(store, rel, codec, fjob)
        if entry is not None:
            return entry
    if fjob.encoded:  # frames encoded on the device: only the persist process writes them as they are
        device_encode.restore_native(fjob.encoded, fjob.plan.storages)
    raw = store.open_write(rel, expected_bytes=fjob.plan.data_nbytes)  # compressed: smaller
    try:
        checked = ChecksumWriter(raw)
        encoder = codec.encoder(checked)
        counting = _CountingSink(encoder)
        if fjob.records is not None:  # chunks are reused once passed on: a codec must be done reading them
            fjob.records.barrier = getattr(encoder, "drain", None)
        if fjob.format == "mdlus":
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


def parallel_write_applies(store: Store, codec: Any, fjob: FileJob) -> bool:
    """Positional multi-threaded writes: local files, no codec (codecs parallelise compression already)."""
    return (
        getattr(store, "is_local", False)
        and getattr(codec, "name", None) == "none"
        and fjob.format in ("pt", "mdlus")
    )


def encoded_write_applies(store: Store, codec: Any, fjob: FileJob) -> bool:
    """The persist process encodes the file (:func:`checkpointd.storage.ptlayout.write_encoded_file`): local
    files of a chunked codec whose bytes are all staged when the file is written (no host budget)."""
    return (
        getattr(store, "is_local", False)
        and getattr(codec, "name", None) in ("zstd", "zstd-planes")
        and fjob.format in ("pt", "mdlus")
        and fjob.records is None
    )


def _write_encoded(store: Store, rel: str, codec: Any, fjob: FileJob) -> FileEntry | None:
    """Lay the zip out, have the persist process checksum, encode and write it; None where it cannot."""
    image = _take_image(store, rel, fjob)
    hints = {key: plane_itemsize(dtype) for key, dtype in _record_dtypes(image, fjob.dtypes or {}).items()}
    result = ptlayout.write_encoded_file(store.path(rel), image, codec.name, codec.level, codec.chunk_bytes, hints,
                                         root=store.root, recycle_from=recyclebin.bin_for(store), encoded=fjob.encoded)
    if result is None:
        return None
    fjob.recycled = result.recycled
    return FileEntry(path=fjob.rel_path, size=result.nbytes, checksum=format_crc(result.crc), codec=codec.name,
                     format=fjob.format, rank=fjob.rank, raw_size=result.raw_nbytes)


def _record_dtypes(image: ziplayout.ZipImage, dtypes: dict[str, Any]) -> dict[int, Any]:
    """The dtype of each record's pieces (by ``id``), nested images included."""
    out: dict[int, Any] = {}
    for member in image.members:
        if isinstance(member.content, ziplayout.ZipImage):
            out.update(_record_dtypes(member.content, dtypes))
            continue
        name = member.name.decode("utf-8")
        if "/data/" in name:
            for piece in member.content:
                out[id(piece)] = dtypes.get(name.rsplit("/data/", 1)[1])
    return out


def _write_parallel(store: Store, rel: str, codec: Any, fjob: FileJob, fast: bool) -> FileEntry:
    """Lay the zip out in advance and write it with ``os.pwrite`` from the shared I/O pool.

    The manifest checksum (CRC-32 of the file as stored) is combined from the CRCs that the writing
    threads computed on each chunk; no byte is read twice. A failure removes the partial file.
    """
    image = _take_image(store, rel, fjob)
    result = ptlayout.write_file(store.path(rel), image, fill=fjob.records.fill if fjob.records is not None else None,
                                 fast=fast, recycle_from=recyclebin.bin_for(store), root=store.root)
    fjob.recycled = result.recycled
    return FileEntry(path=fjob.rel_path, size=result.nbytes, checksum=format_crc(result.crc), codec=codec.name,
                     format=fjob.format, rank=fjob.rank, raw_size=result.nbytes)


def _take_image(store: Store, rel: str, fjob: FileJob) -> Any:
    """The job's zip image (laid out now unless planning did), with the file's directory made. An image
    is written once (its pieces record CRCs): a retry lays it out again."""
    image = fjob.image if fjob.image is not None else file_image(fjob)
    fjob.image = None
    store.makedirs(rel.rsplit("/", 1)[0] if "/" in rel else "")
    return image


def file_image(fjob: FileJob) -> Any:
    """The zip image (every offset fixed) of a ``pt`` or ``mdlus`` file job, for positional writes."""
    if fjob.format == "mdlus":
        return ziplayout.mdlus_image(fjob.json_members or {}, fjob.plan)
    return ziplayout.pt_image(fjob.plan)


def _discard(raw: Any) -> None:
    try:
        if hasattr(raw, "discard"):
            raw.discard()
        else:
            raw.close()
    except Exception:  # noqa: BLE001 - best effort; the step stays uncommitted either way
        pass
