"""The zip layout of a ``.pt`` (or ``.mdlus``) file, computed before a byte is written.

On a local file every record's size is known from the plan, so the whole zip can be laid out first:

    [local header 0][data.pkl] ... [local header k][record k, aligned] ... [central directory][end]

Local headers carry CRC and sizes (no data descriptors), with a padding extra field so every tensor
record starts on an aligned offset (64 bytes, as ``.storage_alignment`` says; 4 KiB for records of
64 KiB or more, which keeps writes page-aligned and suits ``torch.load(mmap=True)``). The layout is a
list of :class:`Piece` byte ranges: member contents (given bytes, or :class:`Deferred` members whose
bytes arrive while the file is written, under a host staging budget) and the headers and trailer,
whose bytes :meth:`ZipImage.finalize` generates once every content piece's CRC-32 is known.

``.mdlus`` files nest a ``.pt`` image as the stored member ``model.pt``; its layout is computed the
same way, relative to its own start.

The files are ordinary zips: Python's ``zipfile``, ``torch.load`` (miniz) and PhysicsNeMo read them.
Zip64 records are written where a size or offset reaches ``zip64_limit`` (a parameter so tests can
exercise them without 4 GiB files). This module computes offsets and bytes only; writing the pieces
is :mod:`checkpointd.storage.ptlayout`'s.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from checkpointd.codecs.crc import crc32, crc32_combine
from checkpointd.format.mdlus import ARGS_MEMBER, METADATA_MEMBER, MODEL_MEMBER
from checkpointd.format.serialize import ARCHIVE_DIR, storage_view

ZIP64_LIMIT = 0xFFFFFFFF
"""Sizes and offsets at or above this go to zip64 extra fields (the format's own limit)."""
SMALL_ALIGN = 64
"""Alignment of a record's data (``.storage_alignment``)."""
LARGE_ALIGN = 4096
"""Alignment of records of :data:`LARGE_RECORD_BYTES` or more (page-aligned writes and mappings)."""
LARGE_RECORD_BYTES = 64 << 10
"""Records from this size on are page-aligned, and written by the persist process where staged there."""

_DOS_DATE = (0 << 9) | (1 << 5) | 1  # 1980-01-01
_DOS_TIME = 0
_LOCAL = struct.Struct("<IHHHHHIIIHH")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_EOCD = struct.Struct("<IHHHHIIH")
_EOCD64 = struct.Struct("<IQHHIIQQQQ")
_LOCATOR64 = struct.Struct("<IIQI")
_PAD_EXTRA_ID = 0x4246  # "FB": the padding field PyTorch's own writer uses


@dataclass
class Piece:
    """A contiguous byte range of the file: given bytes (``data``) or bytes generated at finalize."""

    offset: int
    length: int
    data: Any = None
    crc: int | None = None


@dataclass(frozen=True)
class Deferred:
    """Member content whose bytes arrive while the file is written (host budget); the size is known."""

    key: str
    nbytes: int


@dataclass
class ZipMember:
    """One member of a :class:`ZipImage`: its local header piece and its content (pieces, or a nested zip)."""

    name: bytes
    header: Piece
    data_offset: int
    size: int
    content: list[Piece] | ZipImage
    crc: int = 0


@dataclass
class ZipImage:
    """A zip whose every offset is fixed; pieces in file order once :meth:`pieces` is called."""

    origin: int
    zip64_limit: int
    members: list[ZipMember] = field(default_factory=list)
    trailer: Piece | None = None
    end: int = 0

    def pieces(self) -> list[Piece]:
        out: list[Piece] = []
        for m in self.members:
            out.append(m.header)
            out.extend(m.content.pieces() if isinstance(m.content, ZipImage) else m.content)
        assert self.trailer is not None
        out.append(self.trailer)
        return out

    def data_pieces(self) -> list[Piece]:
        """Pieces of member contents (known bytes, or :class:`Deferred`), in file order."""
        out: list[Piece] = []
        for m in self.members:
            if isinstance(m.content, ZipImage):
                out.extend(m.content.data_pieces())
            else:
                out.extend(m.content)
        return out

    def finalize(self) -> list[Piece]:
        """Generate headers and trailer from the data pieces' CRCs; returns the generated pieces."""
        generated: list[Piece] = []
        for m in self.members:
            if isinstance(m.content, ZipImage):
                generated.extend(m.content.finalize())
                parts = m.content.pieces()
            else:
                parts = m.content
            crc = 0
            for p in parts:
                assert p.crc is not None, "a piece was not written"
                crc = crc32_combine(crc, p.crc, p.length)
            m.crc = crc
            m.header.data = self._local_header(m)
            assert len(m.header.data) == m.header.length
            generated.append(m.header)
        assert self.trailer is not None
        self.trailer.data = self._trailer()
        assert len(self.trailer.data) == self.trailer.length
        generated.append(self.trailer)
        for p in generated:
            p.crc = crc32(p.data)
        return generated

    # -- encoding --------------------------------------------------------------------------------
    def _local_header(self, m: ZipMember) -> bytes:
        zip64 = m.size >= self.zip64_limit
        extra = struct.pack("<HHQQ", 1, 16, m.size, m.size) if zip64 else b""
        fixed = _LOCAL.size + len(m.name) + len(extra)
        pad = m.header.length - fixed
        if pad:
            extra += struct.pack("<HH", _PAD_EXTRA_ID, pad - 4) + b"\0" * (pad - 4)
        size32 = 0xFFFFFFFF if zip64 else m.size
        return _LOCAL.pack(0x04034B50, 45 if zip64 else 20, _flags(m.name), 0, _DOS_TIME, _DOS_DATE, m.crc,
                           size32, size32, len(m.name), len(extra)) + m.name + extra

    def _trailer(self) -> bytes:
        lim = self.zip64_limit
        cd = bytearray()
        for m in self.members:
            rel = m.header.offset - self.origin
            extra = b""
            if m.size >= lim:
                extra += struct.pack("<QQ", m.size, m.size)
            if rel >= lim:
                extra += struct.pack("<Q", rel)
            if extra:
                extra = struct.pack("<HH", 1, len(extra)) + extra
            version = 45 if extra else 20
            size32 = 0xFFFFFFFF if m.size >= lim else m.size
            cd += _CENTRAL.pack(0x02014B50, version, version, _flags(m.name), 0, _DOS_TIME, _DOS_DATE, m.crc,
                                size32, size32, len(m.name), len(extra), 0, 0, 0, 0,
                                0xFFFFFFFF if rel >= lim else rel)
            cd += m.name + extra
        cd_offset = self.trailer.offset - self.origin  # type: ignore[union-attr]
        n = len(self.members)
        out = bytes(cd)
        if _needs_zip64_end(n, len(cd), cd_offset, lim):
            eocd64_offset = cd_offset + len(cd)
            out += _EOCD64.pack(0x06064B50, _EOCD64.size - 12, 45, 45, 0, 0, n, n, len(cd), cd_offset)
            out += _LOCATOR64.pack(0x07064B50, 0, eocd64_offset, 1)
            out += _EOCD.pack(0x06054B50, 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0)
        else:
            out += _EOCD.pack(0x06054B50, 0, 0, n, n, len(cd), cd_offset, 0)
        return out


def _flags(name: bytes) -> int:
    try:
        name.decode("ascii")
        return 0
    except UnicodeDecodeError:
        return 0x800


def _needs_zip64_end(n: int, cd_size: int, cd_offset: int, lim: int) -> bool:
    return n >= 0xFFFF or cd_size >= lim or cd_offset >= lim


def _central_size(name: bytes, size: int, rel_offset: int, lim: int) -> int:
    extra = (16 if size >= lim else 0) + (8 if rel_offset >= lim else 0)
    return _CENTRAL.size + len(name) + (4 + extra if extra else 0)


Content = Any
"""A member's content: ``bytes`` / ``memoryview`` (one piece), or a callable ``origin -> ZipImage``."""


def build_zip(members: Iterable[tuple[str, Content, int]], origin: int = 0,
              zip64_limit: int = ZIP64_LIMIT) -> ZipImage:
    """Lay out a stored zip starting at file offset ``origin``.

    Args:
        members: ``(name, content, alignment)``: data starts at a multiple of ``alignment`` counted
            from ``origin`` (1 for none). A callable content builds a nested zip at the origin it is given.
    """
    img = ZipImage(origin=origin, zip64_limit=zip64_limit)
    pos = origin
    cd_size = 0
    for name, content, align in members:
        bname = name.encode("utf-8")
        fixed = _LOCAL.size + len(bname)
        header_offset = pos
        # The zip64 decision depends on the size, which a nested image knows only once built at its
        # origin; its origin depends on the header length. Nested images are never aligned differently
        # by a zip64 field: compute the header assuming no zip64, build, and redo if the size says so.
        for zip64 in (False, True):
            hdr_len = fixed + (20 if zip64 else 0)
            pad = (-(pos + hdr_len - origin)) % align if align > 1 else 0
            if 0 < pad < 4:
                pad += align
            hdr_len += pad
            data_offset = pos + hdr_len
            if isinstance(content, Deferred):
                size = content.nbytes
                body: list[Piece] | ZipImage = [Piece(data_offset, size, content)]
            elif callable(content):
                body = content(data_offset)
                size = body.end - data_offset  # type: ignore[union-attr]
            else:
                view = memoryview(content).cast("B")
                size = view.nbytes
                body = [Piece(data_offset, size, view)]
            if (size >= zip64_limit) == zip64:
                break
        m = ZipMember(name=bname, header=Piece(header_offset, hdr_len), data_offset=data_offset, size=size, content=body)
        img.members.append(m)
        cd_size += _central_size(bname, size, header_offset - origin, zip64_limit)
        pos = data_offset + size
    n = len(img.members)
    trailer_len = cd_size + _EOCD.size
    if _needs_zip64_end(n, cd_size, pos - origin, zip64_limit):
        trailer_len += _EOCD64.size + _LOCATOR64.size
    img.trailer = Piece(pos, trailer_len)
    img.end = pos + trailer_len
    return img


def pt_members(plan: Any, align_small: int = SMALL_ALIGN, align_large: int = LARGE_ALIGN) -> list[tuple[str, Content, int]]:
    """The members of a ``.pt`` file, exactly those :func:`checkpointd.format.serialize.write_pt` writes."""
    a = ARCHIVE_DIR
    out: list[tuple[str, Content, int]] = [
        (f"{a}/data.pkl", plan.pickle_bytes, 1),
        (f"{a}/.format_version", b"1", 1),
        (f"{a}/.storage_alignment", str(align_small).encode(), 1),
        (f"{a}/byteorder", sys.byteorder.encode(), 1),
    ]
    kept = getattr(plan, "views", {})  # byte views a ReductionCache kept from earlier saves
    for key, holder in plan.storages:
        view: Any = kept.get(key)
        if view is None:
            view = Deferred(key, holder.untyped_storage().nbytes()) if holder.device.type == "meta" else storage_view(holder)
        nbytes = view.nbytes
        out.append((f"{a}/data/{key}", view, align_large if nbytes >= LARGE_RECORD_BYTES else align_small))
    out.append((f"{a}/version", b"3\n", 1))
    return out


def pt_image(plan: Any, origin: int = 0, zip64_limit: int = ZIP64_LIMIT) -> ZipImage:
    """The ``.pt`` zip of ``plan`` (a :class:`checkpointd.format.serialize.PtPlan`) from file offset ``origin``."""
    return build_zip(pt_members(plan), origin, zip64_limit)


def mdlus_image(json_members: dict[str, bytes], plan: Any, zip64_limit: int = ZIP64_LIMIT) -> ZipImage:
    """The ``.mdlus`` zip: ``args.json``, ``metadata.json``, then ``model.pt`` (a nested ``.pt`` image)."""
    missing = {ARGS_MEMBER, METADATA_MEMBER} - json_members.keys()
    if missing:
        raise ValueError(f"mdlus: json_members lacks {sorted(missing)}; build it with mdlus_json_members()")
    return build_zip([
        (ARGS_MEMBER, json_members[ARGS_MEMBER], 1),
        (METADATA_MEMBER, json_members[METADATA_MEMBER], 1),
        (MODEL_MEMBER, lambda origin: pt_image(plan, origin, zip64_limit), LARGE_ALIGN),
    ], 0, zip64_limit)


__all__ = ["Content", "Deferred", "LARGE_ALIGN", "LARGE_RECORD_BYTES", "Piece", "SMALL_ALIGN", "ZIP64_LIMIT", "ZipImage",
           "ZipMember", "build_zip", "mdlus_image", "pt_image", "pt_members"]
