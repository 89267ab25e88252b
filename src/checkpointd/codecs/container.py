"""The seek table that ends every chunked codec file: its byte layout, writing it and reading it back.

A ``zstd`` or ``zstd-planes`` file (:mod:`checkpointd.codecs.compress` documents both) is a run of
frames followed by one skippable frame, the seek table: ``<u32 SKIPPABLE_INDEX_MAGIC><u32 body size>``,
then one ``<u32 compressed size, u32 decompressed size>`` entry per frame, then the footer
``<u32 frame count><u8 descriptor><u32 footer magic>``. The footer magic names the codec:
:data:`SEEKABLE_FOOTER_MAGIC` (zstd's own seekable format) or :data:`PLANES_FOOTER_MAGIC`.
"""

from __future__ import annotations

import io
import struct
from typing import Any, Protocol

from checkpointd.errors import CorruptCheckpointError

SKIPPABLE_INDEX_MAGIC = 0x184D2A5E
"""Magic of the skippable frame that holds the seek table."""
SEEKABLE_FOOTER_MAGIC = 0x8F92EAB1
"""Footer magic of zstd's seekable format (``contrib/seekable_format``), used by the ``zstd`` codec."""
PLANES_FOOTER_MAGIC = 0x31504B43
"""Footer magic of the ``zstd-planes`` container (``b"CKP1"``)."""

FRAME_HEADER = struct.Struct("<II")
"""A skippable frame's header: magic, payload size."""
ENTRY = struct.Struct("<II")
"""A seek table entry: frame size, native size."""
FOOTER = struct.Struct("<IBI")
"""The seek table's footer: frame count, descriptor, magic."""


class IndexSource(Protocol):
    """What the seek table is read from: a seekable binary stream."""

    def seek(self, offset: int, whence: int = ..., /) -> int: ...

    def read(self, nbytes: int = ..., /) -> Any: ...


def seek_table(entries: list[tuple[int, int]], footer_magic: int) -> bytes:
    """The seek table frame for ``(frame size, native size)`` entries."""
    body = b"".join(ENTRY.pack(*e) for e in entries) + FOOTER.pack(len(entries), 0, footer_magic)
    return FRAME_HEADER.pack(SKIPPABLE_INDEX_MAGIC, len(body)) + body


def read_index(raw: IndexSource, footer_magic: int, codec_name: str) -> tuple[list[int], list[int]]:
    """Frame offsets and native offsets (each with a final end offset) from the trailing seek table.

    Raises:
        CorruptCheckpointError: no valid seek table (truncated, or not written by checkpointd).
    """
    end = raw.seek(0, io.SEEK_END)
    hint = f"the {codec_name!r} file is truncated, corrupt, or was not written by checkpointd"
    if end < FRAME_HEADER.size + FOOTER.size:
        raise CorruptCheckpointError(f"{hint}: {end} bytes is too short for a seek table")
    raw.seek(end - FOOTER.size)
    count, descriptor, magic = FOOTER.unpack(read_exact(raw, FOOTER.size, hint))
    if magic != footer_magic or descriptor & 0x7F:
        raise CorruptCheckpointError(f"{hint}: no seek table at the end (magic {magic:#x})")
    entry_size = ENTRY.size + (4 if descriptor & 0x80 else 0)  # bit 7: per-frame checksums follow
    table_nbytes = FRAME_HEADER.size + count * entry_size + FOOTER.size
    if table_nbytes > end:
        raise CorruptCheckpointError(f"{hint}: seek table of {count} frames exceeds the file")
    raw.seek(end - table_nbytes)
    table = memoryview(read_exact(raw, table_nbytes - FOOTER.size, hint))
    frame_magic, body_nbytes = FRAME_HEADER.unpack_from(table)
    if frame_magic != SKIPPABLE_INDEX_MAGIC or body_nbytes != table_nbytes - FRAME_HEADER.size:
        raise CorruptCheckpointError(f"{hint}: bad seek table frame header")
    frame_offsets, native_offsets = [0], [0]
    for i in range(count):
        frame_nbytes, native_nbytes = ENTRY.unpack_from(table, FRAME_HEADER.size + i * entry_size)
        frame_offsets.append(frame_offsets[-1] + frame_nbytes)
        native_offsets.append(native_offsets[-1] + native_nbytes)
    if frame_offsets[-1] != end - table_nbytes:
        raise CorruptCheckpointError(f"{hint}: frames span {frame_offsets[-1]} bytes, the file {end - table_nbytes}")
    return frame_offsets, native_offsets


def read_exact(raw: IndexSource, nbytes: int, hint: str) -> bytes:
    """Exactly ``nbytes`` from ``raw``, or :class:`CorruptCheckpointError` naming ``hint``."""
    data = raw.read(nbytes)
    if data is None or len(data) != nbytes:
        raise CorruptCheckpointError(f"{hint}: short read ({0 if data is None else len(data)} of {nbytes} bytes)")
    return data


class ViewFile:
    """``seek``/``read`` over a memoryview, copying only what is read (for the seek table)."""

    def __init__(self, view: memoryview) -> None:
        self._view, self._pos = view, 0

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._pos = offset + (self._view.nbytes if whence == io.SEEK_END else 0)
        return self._pos

    def read(self, nbytes: int = -1) -> bytes:
        stop = self._view.nbytes if nbytes < 0 else self._pos + nbytes
        data = bytes(self._view[self._pos : stop])
        self._pos += len(data)
        return data


__all__ = ["ENTRY", "FOOTER", "FRAME_HEADER", "PLANES_FOOTER_MAGIC", "SEEKABLE_FOOTER_MAGIC", "SKIPPABLE_INDEX_MAGIC",
           "ViewFile", "read_exact", "read_index", "seek_table"]
