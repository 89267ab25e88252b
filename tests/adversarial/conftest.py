"""Fixtures of the attack suite: a checkpoint root with an OUTSIDE directory beside it, and a fingerprint
of everything outside the root, so each attack can assert that nothing outside changed."""

from __future__ import annotations

import gc
import hashlib
import os
from pathlib import Path

import pytest


def fingerprint(top: Path) -> dict[str, tuple]:
    """``{relative path: (kind, size, sha256, nlink, link target)}`` of every entry under ``top``, links not followed."""
    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(top, followlinks=False):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            rel = str(path.relative_to(top))
            st = path.lstat()
            if path.is_symlink():
                out[rel] = ("link", 0, "", st.st_nlink, os.readlink(path))
            elif path.is_dir():
                out[rel] = ("dir", 0, "", 0, "")
            elif path.is_file():
                out[rel] = ("file", st.st_size, hashlib.sha256(path.read_bytes()).hexdigest(), st.st_nlink, "")
            else:
                out[rel] = ("other", 0, "", st.st_nlink, "")
    return out


@pytest.fixture(scope="package", autouse=True)
def collector_managed_by_the_suite():
    """The cyclic garbage collector off while the attack suite runs, as an application that manages it
    itself: a manager then leaves the heap alone (``StagingOptions.freeze_gc`` applies to an enabled
    collector), where it would otherwise run a full collection of the test runner's heap at each
    construction (about a second with torch loaded). Nothing here depends on when cycles are collected;
    the young generations are collected after each test, everything once at the end."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
        gc.collect()


@pytest.fixture(autouse=True)
def collect_young_garbage():
    """Each test's cyclic garbage (the young generations: milliseconds) collected after it."""
    yield
    gc.collect(1)


@pytest.fixture
def outside(tmp_path: Path):
    """A directory beside the root holding files an attack points at; yields (path, check) where
    ``check()`` asserts that nothing under it changed since the fixture made it."""
    top = tmp_path / "outside"
    top.mkdir()
    (top / "precious.bin").write_bytes(os.urandom(1 << 16))
    (top / "notes.txt").write_text("do not touch\n")
    (top / "sub").mkdir()
    (top / "sub" / "data.pt").write_bytes(os.urandom(4096))
    before = fingerprint(top)

    def check() -> None:
        after = fingerprint(top)
        assert after == before, f"files outside the root changed: {sorted(set(after.items()) ^ set(before.items()))[:5]}"

    return top, check


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "root"
