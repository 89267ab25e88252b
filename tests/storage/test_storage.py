"""Store: one conformance suite for local disk, memory:// and a real S3 server, plus faults.

The fault tests run the Store on ``faulty://`` built from ``storage_options`` only, the way
``CheckpointManager(root, state, storage_options=...)`` builds it.
"""

from __future__ import annotations

import errno
import hashlib
import os
import time
import uuid
from pathlib import Path
from typing import Any

import fsspec
import pytest

from checkpointd.storage.retry import NO_RETRY, RetryPolicy
from checkpointd.storage.store import Store
from checkpointd.testing.faults import (
    Fault,
    FaultPlan,
    FaultyFileSystem,
    SmallFilesystemUnavailable,
    permanent_error,
    small_filesystem,
    timeout_error,
)

FAST_RETRY = RetryPolicy(initial_backoff_secs=0.001, max_backoff_secs=0.01, max_elapsed_secs=10.0)
MiB = 2**20


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}


@pytest.fixture(params=["local", "memory", "s3"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, Any]]:
    """(root URL, storage_options) of a fresh, empty root on each backend."""
    if request.param == "local":
        return str(tmp_path / "root"), {}
    if request.param == "memory":
        return f"memory://ckpt-{uuid.uuid4().hex}", {}
    return request.getfixturevalue("s3_root"), request.getfixturevalue("s3_storage_options")


def faulty_backend(backend: tuple[str, dict[str, Any]], plan: FaultPlan) -> tuple[str, dict[str, Any]]:
    """The same root behind ``faulty://``, configured through storage_options alone."""
    root, options = backend
    protocol, _, path = root.rpartition("://")
    protocol = protocol or "file"
    if protocol == "file":
        path = os.path.abspath(path)
    return f"faulty://{path}", {"target_protocol": protocol, "target_options": options, "faults": plan}


class TestStoreConformance:
    """What the commit protocol relies on, on every backend."""

    def test_write_read_roundtrip(self, backend: tuple[str, dict[str, Any]]) -> None:
        store = Store(*backend)
        store.write_bytes("step-000000001/a.bin", b"hello")
        store.write_bytes("step-000000001/sub/b.bin", memoryview(b"world"))
        assert store.read_bytes("step-000000001/a.bin") == b"hello"
        assert store.read_bytes("step-000000001/sub/b.bin") == b"world"
        assert store.size("step-000000001/a.bin") == 5
        with store.open_read("step-000000001/a.bin") as f:
            assert f.read() == b"hello"

    def test_exists_and_is_file(self, backend: tuple[str, dict[str, Any]]) -> None:
        store = Store(*backend)
        assert not store.exists("d/x")
        assert not store.is_file("d/x")
        store.write_bytes("d/x", b"1")
        assert store.exists("d/x")
        assert store.exists("d")
        assert store.is_file("d/x")
        assert not store.is_file("d")

    def test_list_dir(self, backend: tuple[str, dict[str, Any]]) -> None:
        store = Store(*backend)
        assert store.list_dir("") == []
        assert store.list_dir("missing") == []
        for rel in ["step-000000002/a", "step-000000001/b", "step-000000001/c/d", "top"]:
            store.write_bytes(rel, b"x")
        assert store.list_dir("") == ["step-000000001", "step-000000002", "top"]
        assert store.list_dir("step-000000001") == ["b", "c"]

    def test_list_dir_of_a_file_raises(self, backend: tuple[str, dict[str, Any]]) -> None:
        store = Store(*backend)
        store.write_bytes("f", b"x")
        with pytest.raises(NotADirectoryError):
            store.list_dir("f")

    def test_overwrite_replaces(self, backend: tuple[str, dict[str, Any]]) -> None:
        store = Store(*backend)
        store.write_bytes("a", b"first version")
        store.write_bytes("a", b"second")
        assert store.read_bytes("a") == b"second"

    def test_remove_tree_and_remove(self, backend: tuple[str, dict[str, Any]]) -> None:
        store = Store(*backend)
        for rel in ["s1/a", "s1/b/c", "s2/a"]:
            store.write_bytes(rel, b"x")
        store.remove_tree("s1")
        assert store.list_dir("") == ["s2"]
        assert not store.exists("s1/b/c")
        store.remove("s2/a")
        assert not store.exists("s2/a")
        store.remove_tree("never-existed")  # missing is not an error
        store.remove("never-existed")

    def test_open_write_commits_on_close(self, backend: tuple[str, dict[str, Any]]) -> None:
        store = Store(*backend)
        with store.open_write("d/streamed") as f:
            for i in range(10):
                assert f.write(bytes([i]) * 1000) == 1000
            assert f.tell() == 10_000
        assert store.read_bytes("d/streamed") == b"".join(bytes([i]) * 1000 for i in range(10))

    def test_exception_in_open_write_leaves_nothing(self, backend: tuple[str, dict[str, Any]]) -> None:
        store = Store(*backend)
        with pytest.raises(RuntimeError, match="serializer broke"):
            with store.open_write("d/partial") as f:
                f.write(b"half of it")
                raise RuntimeError("serializer broke")
        assert not store.exists("d/partial")

    def test_abort_leaves_nothing(self, backend: tuple[str, dict[str, Any]]) -> None:
        store = Store(*backend)
        f = store.open_write("d/partial")
        f.write(b"x" * 100)
        f.discard()
        assert not store.exists("d/partial")

    def test_root_that_is_a_file_gives_a_clear_error(self, backend: tuple[str, dict[str, Any]]) -> None:
        root, options = backend
        Store(*backend).write_bytes("afile", b"x")
        store = Store(root.rstrip("/") + "/afile", options)
        with pytest.raises(NotADirectoryError, match="is a file, not a directory"):
            store.write_bytes("step-000000001/x", b"y")
        with pytest.raises(NotADirectoryError, match="is a file, not a directory"):
            store.list_dir("")
        assert store.read_bytes("") == b"x"  # load() of a single file still works


class TestFaults:
    """Transient errors are retried, permanent ones surface, and nothing partial appears."""

    def test_exists_raises_on_transient_error_instead_of_false(self, backend: tuple[str, dict[str, Any]]) -> None:
        plan = FaultPlan()
        store = Store(*faulty_backend(backend, plan), retry=RetryPolicy(max_elapsed_secs=0.05))
        store.write_bytes("d/COMMITTED", b"m")
        plan.add(Fault(op="info"))
        with pytest.raises(ConnectionResetError):
            store.exists("d/COMMITTED")
        with pytest.raises(ConnectionResetError):
            store.exists("d/missing")
        assert len(plan.failures("info")) >= 4  # retried before giving up

    def test_timeouts_are_retried(self, backend: tuple[str, dict[str, Any]]) -> None:
        plan = FaultPlan()
        store = Store(*faulty_backend(backend, plan), retry=FAST_RETRY)
        store.write_bytes("a", b"1")
        plan.add(Fault(op="info", delay_secs=0.02, error=timeout_error, times=2))
        assert store.exists("a")
        assert len(plan.failures("info")) == 2

    def test_retries_recover_from_a_fraction_of_transient_errors(self, backend: tuple[str, dict[str, Any]]) -> None:
        plan = FaultPlan(Fault(op="*", probability=0.3), seed=1)
        store = Store(*faulty_backend(backend, plan), retry=FAST_RETRY)
        blobs = {f"step-000000001/f{i}": os.urandom(100 + i) for i in range(15)}
        for rel, data in blobs.items():
            store.write_bytes(rel, data)
        assert store.list_dir("step-000000001") == sorted(rel.rsplit("/", 1)[-1] for rel in blobs)
        for rel, data in blobs.items():
            assert store.exists(rel)
            assert store.read_bytes(rel) == data
        assert len(plan.failures()) >= 10
        assert {f.op for f in plan.failures()} >= {"open", "write", "close", "info", "read"}

    def test_failing_exactly_the_marker(self, backend: tuple[str, dict[str, Any]]) -> None:
        plan = FaultPlan(Fault(op="close", path="*/COMMITTED", error=permanent_error))
        store = Store(*faulty_backend(backend, plan), retry=FAST_RETRY)
        store.write_bytes("step-000000001/manifest.json", b"{}")
        with pytest.raises(PermissionError):
            store.write_bytes("step-000000001/COMMITTED", b"checksum")
        assert not store.exists("step-000000001/COMMITTED")
        assert store.read_bytes("step-000000001/manifest.json") == b"{}"
        assert len(plan.failures()) == 1  # permanent: not retried

    def test_nth_write_fails_then_next_attempt_works(self, backend: tuple[str, dict[str, Any]]) -> None:
        plan = FaultPlan(Fault(op="write", nth=2))
        store = Store(*faulty_backend(backend, plan), retry=NO_RETRY)
        with pytest.raises(ConnectionResetError):
            with store.open_write("big") as f:
                f.write(b"a" * 10)
                f.write(b"b" * 10)
        assert not store.exists("big")
        store.retry.call(store.write_bytes, "big", b"c" * 20, describe="rewrite")
        assert store.read_bytes("big") == b"c" * 20

    def test_lost_ack_on_close_lands_the_object(self, backend: tuple[str, dict[str, Any]]) -> None:
        plan = FaultPlan(Fault(op="close", lands=True, error=permanent_error))
        store = Store(*faulty_backend(backend, plan), retry=NO_RETRY)
        with pytest.raises(PermissionError):
            store.write_bytes("x", b"data")
        assert store.read_bytes("x") == b"data"

    def test_simulated_disk_full_surfaces_fast_and_recovers(self, backend: tuple[str, dict[str, Any]]) -> None:
        plan = FaultPlan(disk_capacity_bytes=1000)
        store = Store(*faulty_backend(backend, plan))  # default two-minute retry budget
        store.write_bytes("old", b"o" * 600)
        start = time.monotonic()
        with pytest.raises(OSError) as info:
            store.write_bytes("new", b"n" * 600)
        assert info.value.errno == errno.ENOSPC
        assert time.monotonic() - start < 1.0  # not retried for two minutes
        assert not store.exists("new")
        assert store.read_bytes("old") == b"o" * 600
        plan.free_disk()
        store.write_bytes("new", b"n" * 600)
        assert store.read_bytes("new") == b"n" * 600

    def test_disabled_plan_lets_everything_through(self, tmp_path: Path) -> None:
        plan = FaultPlan(Fault(op="*"))
        plan.enabled = False
        store = Store(f"faulty://{tmp_path}", {"faults": plan})
        store.write_bytes("a", b"1")
        assert store.read_bytes("a") == b"1"
        assert plan.calls["open"] == 1 and plan.injected == []

    def test_fsspec_opens_faulty_urls_directly(self, tmp_path: Path) -> None:
        plan = FaultPlan(Fault(op="close", nth=1))
        fs, path = fsspec.core.url_to_fs(f"faulty://{tmp_path}/x", faults=plan)
        assert isinstance(fs, FaultyFileSystem) and path == f"{tmp_path}/x"
        with pytest.raises(ConnectionResetError):
            with fs.open(path, "wb") as f:
                f.write(b"abc")
        assert not (tmp_path / "x").exists()
        fs.pipe_file(path, b"abc")
        assert (tmp_path / "x").read_bytes() == b"abc"

    @pytest.mark.parametrize("kwargs", [{"op": "nope"}, {"nth": 0}, {"probability": 1.5}])
    def test_bad_faults_raise(self, kwargs: dict[str, Any]) -> None:
        with pytest.raises(ValueError):
            Fault(**kwargs)


class TestS3:
    def test_multipart_upload_roundtrips_bit_exact(self, s3_root: str, s3_storage_options: dict[str, Any]) -> None:
        store = Store(s3_root, s3_storage_options, part_size_bytes=5 * MiB, max_parts_in_flight=3)
        data = os.urandom(23 * MiB + 12345)
        chunks = [data[i:i + 3 * MiB + 7] for i in range(0, len(data), 3 * MiB + 7)]
        with store.open_write("step-000000001/model.pt") as f:
            for chunk in chunks:
                f.write(chunk)
            assert not store.exists("step-000000001/model.pt")  # invisible until complete
        assert store.size("step-000000001/model.pt") == len(data)
        back = store.read_bytes("step-000000001/model.pt")
        assert hashlib.sha256(back).digest() == hashlib.sha256(data).digest()
        etag = store.fs.info(store.path("step-000000001/model.pt"))["ETag"].strip('"')
        assert etag.endswith("-5")  # five parts of 5 MiB, the last one smaller

    def test_failed_multipart_upload_is_aborted(self, s3_root: str, s3_storage_options: dict[str, Any]) -> None:
        plan = FaultPlan(Fault(op="write", nth=4, error=permanent_error))
        root = "faulty://" + s3_root.removeprefix("s3://")
        store = Store(root, {"target_protocol": "s3", "target_options": s3_storage_options, "faults": plan},
                      part_size_bytes=5 * MiB, max_parts_in_flight=2)
        with pytest.raises(PermissionError):
            with store.open_write("big") as f:
                for _ in range(6):
                    f.write(os.urandom(2 * MiB))
        assert not store.exists("big")
        bucket, key = s3_root.removeprefix("s3://").split("/", 1)
        uploads = store.fs.target.list_multipart_uploads(bucket)
        assert not [u for u in uploads if u["Key"].startswith(key)]

    def test_list_dir_is_never_stale(self, s3_root: str, s3_storage_options: dict[str, Any]) -> None:
        store = Store(s3_root, s3_storage_options)
        store.write_bytes("step-000000001/a", b"1")
        assert store.list_dir("") == ["step-000000001"]
        other = fsspec.filesystem("s3", skip_instance_cache=True, **s3_storage_options)
        other.pipe_file(store.path("step-000000002/COMMITTED"), b"m")  # another writer (or rank)
        assert store.list_dir("") == ["step-000000001", "step-000000002"]
        assert store.exists("step-000000002/COMMITTED")
        other.rm_file(store.path("step-000000002/COMMITTED"))
        assert not store.exists("step-000000002/COMMITTED")

    def test_reads_see_an_object_rewritten_after_a_listing(self, s3_root: str, s3_storage_options: dict[str, Any]) -> None:
        # a listing caches each object's ETag; a file another process rewrote since must read as its new
        # bytes, not fail on the stale ETag
        store = Store(s3_root, s3_storage_options)
        store.write_bytes("step-000000000/data.pt", b"old bytes")
        assert store.list_dir("step-000000000") == ["data.pt"]
        other = fsspec.filesystem("s3", skip_instance_cache=True, **s3_storage_options)
        other.pipe_file(store.path("step-000000000/data.pt"), b"new bytes, longer")
        with store.open_read("step-000000000/data.pt") as f:
            assert f.read() == b"new bytes, longer"
        assert store.read_bytes("step-000000000/data.pt") == b"new bytes, longer"


def test_real_disk_full_on_a_small_filesystem() -> None:
    try:
        fs_cm = small_filesystem(1 * MiB)
        mountpoint = fs_cm.__enter__()
    except SmallFilesystemUnavailable as exc:
        if _in_ci():
            raise
        pytest.skip(str(exc))
    try:
        store = Store(mountpoint / "ckpt")
        store.write_bytes("step-000000001/a", b"o" * 200_000)
        start = time.monotonic()
        with pytest.raises(OSError) as info:
            store.write_bytes("step-000000002/a", os.urandom(2 * MiB))
        assert info.value.errno == errno.ENOSPC
        assert time.monotonic() - start < 5.0
        assert not store.exists("step-000000002/a")
        assert store.read_bytes("step-000000001/a") == b"o" * 200_000
        store.remove_tree("step-000000001")  # space is back
        store.write_bytes("step-000000003/a", b"n" * 500_000)
        assert store.size("step-000000003/a") == 500_000
    finally:
        fs_cm.__exit__(None, None, None)
    assert not mountpoint.exists()
