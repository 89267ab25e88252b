"""Shared pytest fixtures. Each helper keeps its fixtures in its own section below."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# ==== import path: run from a source checkout without installing ================================
_SRC = Path(__file__).resolve().parent.parent / "src"
if _SRC.is_dir() and str(_SRC) not in sys.path:
    sys.path.insert(0, str(_SRC))


# ==== the test runner's heap: frozen once for the session ========================================
# A manager collects and freezes the heap at construction when no other manager holds a freeze
# (save/gcfreeze.py): a full collection of everything the runner imported (torch, lightning,
# transformers, torchao: ~400,000 objects, 0.3-1 s) for each of the suite's many managers. The session
# holds one freeze instead, taken after collection, as an application whose manager outlives the others
# would; tests/save/test_stall_measures.py exercises the managers' own freeze and gives this one back.

@pytest.fixture(scope="session", autouse=True)
def runner_heap_frozen_once() -> Iterator[None]:
    from checkpointd.save import gcfreeze

    gcfreeze.acquire()
    yield
    gcfreeze.release()


# ==== S3 server (SeaweedFS `weed mini` on 127.0.0.1), storage/retry tests =======================
# One server per test session; every test gets its own fresh prefix. In CI (CI=true) a server that
# cannot start FAILS the tests that need it; elsewhere they are skipped with the reason.

def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A running S3Server (see checkpointd.testing.s3server), killed at the end of the session."""
    from checkpointd.testing.s3server import S3ServerError, start_s3_server

    try:
        server = start_s3_server(tmp_path_factory.mktemp("s3server"), startup_timeout_secs=60)
    except S3ServerError as exc:
        if _in_ci():
            pytest.fail(f"S3 test server did not start in CI: {exc}", pytrace=False)
        pytest.skip(f"S3 test server unavailable (set CI=true to make this a failure): {exc}")
    with server:  # stops the server (process group) even when tests fail
        yield server


@pytest.fixture
def s3_storage_options(s3_server: Any) -> dict[str, Any]:
    """storage_options for s3fs pointing at the test server (a fresh dict per test)."""
    return s3_server.storage_options


@pytest.fixture
def s3_root(s3_server: Any) -> str:
    """A fresh, empty ``s3://<bucket>/<uuid>`` root on the test server."""
    return s3_server.unique_url()
