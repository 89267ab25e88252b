"""CRC-32 combination: zlib-ng's ``crc32_combine`` and the pure-Python fallback agree with ``zlib.crc32``,
and without zlib-ng the fallback is what runs."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from checkpointd.codecs import crc


def _pieces(seed: int) -> tuple[bytes, list[tuple[int, int]]]:
    rng = random.Random(seed)
    data = os.urandom(rng.randint(1, 200_000))
    cuts = sorted(rng.randint(0, len(data)) for _ in range(rng.randint(1, 6)))
    bounds = [0, *cuts, len(data)]
    return data, [(zlib.crc32(data[a:b]), b - a) for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("fallback", [False, True], ids=["zlib-ng", "pure Python"])
@pytest.mark.parametrize("seed", range(6))
def test_combined_crcs_of_random_splits_equal_the_whole_files(seed, fallback, monkeypatch) -> None:
    if fallback:
        monkeypatch.setattr(crc, "COMBINE", None)
    elif crc.COMBINE is None:
        pytest.skip("zlib-ng is not importable here")
    data, pieces = _pieces(seed)
    assert crc.crc32_concat(pieces) == zlib.crc32(data)
    cut = random.Random(seed).randint(0, len(data))
    assert crc.crc32_combine(zlib.crc32(data[:cut]), zlib.crc32(data[cut:]), len(data) - cut) == zlib.crc32(data)


@pytest.mark.parametrize("fallback", [False, True], ids=["zlib-ng", "pure Python"])
def test_edge_cases_match_the_pure_python_port(fallback, monkeypatch) -> None:
    if fallback:
        monkeypatch.setattr(crc, "COMBINE", None)
    elif crc.COMBINE is None:
        pytest.skip("zlib-ng is not importable here")
    assert crc.crc32_combine(0x1234, 0, 0) == 0x1234  # an empty second range changes nothing
    assert crc.crc32_combine(0x1_0000_1234, 0, 0) == 0x1234
    for crc1, crc2, len2 in [(1, 2, 1), (0xFFFFFFFF, 0xFFFFFFFF, 12345), (1 << 33 | 5, 7, 1 << 40), (5, 7, (1 << 63) - 1)]:
        assert crc.crc32_combine(crc1, crc2, len2) == crc.crc32_combine_py(crc1, crc2, len2)
    with pytest.raises(ValueError, match="negative length -1"):
        crc.crc32_combine(1, 2, -1)


def test_zlib_ng_is_used_where_it_imports() -> None:
    pytest.importorskip("zlib_ng")
    assert crc.COMBINE is not None and crc.CRC32_IMPLEMENTATION == "zlib-ng"


def test_without_zlib_ng_the_pure_python_combine_and_another_crc_run() -> None:
    """A process where ``zlib_ng`` cannot be imported: the fallbacks are chosen and give zlib's results."""
    code = ("import sys, zlib; sys.modules['zlib_ng'] = None\n"
            "from checkpointd.codecs import crc\n"
            "data = bytes(range(256)) * 999\n"
            "assert crc.COMBINE is None and crc.CRC32_IMPLEMENTATION in ('isal', 'zlib'), crc.CRC32_IMPLEMENTATION\n"
            "assert crc.crc32(data) == zlib.crc32(data)\n"
            "assert crc.crc32_combine(zlib.crc32(data[:1000]), zlib.crc32(data[1000:]), len(data) - 1000) == zlib.crc32(data)\n"
            "print('ok')\n")
    env = {**os.environ, "PYTHONPATH": str(Path(crc.__file__).parents[2])}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr
