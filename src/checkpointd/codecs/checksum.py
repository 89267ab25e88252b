"""Checksums computed while bytes stream to storage (no second pass over the data).

CRC-32 of the bytes exactly as stored, by :data:`checkpointd.codecs.crc.crc32`: zlib-ng's (15-20 GB/s a
core), else zlib's (~4 GB/s); both release the GIL on large buffers. Why not ``zlib.crc32`` always: a
compressed file's one writer thread checksums every byte it writes, and at zlib's rate that costs about as
much as the write (H200, 4.83 GB zstd save to tmpfs: 1.40-1.68 GB/s with zlib's CRC, 1.68-2.20 with
zlib-ng's).
It detects truncation and corruption; the commit marker additionally pins the manifest with SHA-256,
so a manifest cannot be swapped under a marker.
"""

from __future__ import annotations

import hashlib
from typing import Any

from checkpointd.codecs.crc import crc32

ALGORITHM = "crc32"


class ChecksumWriter:
    """Wraps a binary file: forwards writes, counting bytes and updating a running CRC-32."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self._crc = 0
        self.nbytes = 0

    def write(self, data: Any) -> int:
        view = memoryview(data)
        if view.nbytes:
            self._crc = crc32(view, self._crc)
            self._raw.write(view)
            self.nbytes += view.nbytes
        return view.nbytes

    @property
    def checksum(self) -> str:
        return format_crc(self._crc)


def format_crc(crc: int) -> str:
    return f"{ALGORITHM}:{crc & 0xFFFFFFFF:08x}"


def checksum_bytes(data: Any) -> str:
    return format_crc(crc32(memoryview(data)))


class ChecksumReader:
    """Running CRC-32 over chunks read back, to compare with the manifest."""

    def __init__(self) -> None:
        self._crc = 0
        self.nbytes = 0

    def update(self, data: Any) -> None:
        view = memoryview(data)
        self._crc = crc32(view, self._crc)
        self.nbytes += view.nbytes

    @property
    def checksum(self) -> str:
        return format_crc(self._crc)


def sha256_hex(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()
