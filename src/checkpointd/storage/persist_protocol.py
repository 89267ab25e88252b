"""The persist process's wire protocol: ``marshal``-encoded tuples behind an 8-byte length on a Unix
socket, descriptors riding along as ``SCM_RIGHTS``.

Standard library only: the persist process (:mod:`checkpointd.storage.persist_process_main`) loads this
module by path, without the package; the training process's side
(:mod:`checkpointd.storage.persist_process`) imports it.

Requests (the first field names the kind, the second is the request id where an answer is expected):

- ``("map", slab_id, nbytes)`` + the slab's memfd: map it (kept until ``unmap``);
- ``("unmap", slab_id)``;
- ``("write", request_id, end, mode, lanes, tasks, writeback)`` + the open file: put every range of
  ``tasks`` (lists of ``(file_offset, slab_id, slab_offset, length)``) into the file, by ``pwrite`` or
  through a mapping of it (``mode`` ``mmap``; the file is first reserved up to ``end`` with
  ``posix_fallocate``, so a full disk is ENOSPC, never SIGBUS), ``lanes`` tasks at a time, computing
  each range's CRC-32 slice by slice just before the slice is put; with ``writeback``, the disk is
  started on each range once it is in (``sync_file_range``, see
  :func:`checkpointd.storage.fsinfo.early_writeback`). Replies ``("ok", request_id, crcs per task)``,
  ``("oserror", request_id, errno, text)`` or ``("error", request_id, text)``;
- ``("scatter", request_id, pieces)`` + the open file: ``pwrite`` each ``(file_offset, bytes)`` of
  ``pieces`` (a file's zip headers and small members, a few hundred per file); replies as ``write``,
  with ``None`` for the CRCs (the requester computed them);
- ``("attach", request_id, end, mode, writeback)`` + the open file: hold the file for the ``put``
  requests that follow (a file whose bytes arrive piece by piece: the host-budget chunk ring hands
  over each chunk once it holds its bytes). Reserved and mapped once, as ``write`` does; the request id
  names the file from then on. Replies ``("ok", request_id, None)`` or a failure as ``write``;
- ``("put", request_id, file_id, lanes, tasks)``: ``write``'s work on the attached file ``file_id``;
- ``("detach", request_id, file_id)``: let the attached file go (its mapping is kept as after ``write``);
- ``("keep", request_id, nbytes)`` + the open file: reserve it (``posix_fallocate``), map it, fault its
  pages into the mapping (``MADV_POPULATE_WRITE`` where the kernel has it) and keep the mapping as
  after a write: a blank file made ahead of a run's first saves (:class:`checkpointd.storage.filesahead.FilesAhead`);
- ``("exclusive", request_id, st_dev, st_ino)``: whether the file's mapping the process keeps (see
  :class:`checkpointd.storage.persist_mappings.KeptFile`) is the only open file of it (a write lease on
  the kept descriptor), ``None`` if it keeps none; replies ``("ok", request_id, True | False | None)``;
- ``("crc", request_id, ranges)``: the CRC-32 of each ``(slab_id, slab_offset, length)`` of ``ranges``,
  computed by the process's threads; replies ``("ok", request_id, crcs)``;
- ``("encode", request_id, codec, level, chunk_bytes, mode, pieces)`` + the open file: write the native file
  whose bytes are ``pieces``, in order (``(0, bytes, hint)`` inline or ``(1, slab_id, slab_offset,
  length, hint)``; ``hint``: the element size of a float record's bytes, else 0), encoded with the
  codec ``codec`` (``"zstd"`` or ``"zstd-planes"``, :mod:`checkpointd.codecs.compress`) at ``level`` in
  chunks of ``chunk_bytes``, front to back from offset 0 (``mode`` ``"mmap"``: through a mapping of the
  file, reserved to a bound of the encoded size first; else by ``pwrite``; the file is cut to its end); replies
  ``("ok", request_id, [size, CRC-32 of the file, native size])`` or a failure as ``write``;
- ``("exit",)``: the process exits (as it does when the socket closes).
"""

from __future__ import annotations

import marshal
import os
import socket
import struct

HEADER = struct.Struct("<Q")
"""A message's length, ahead of its payload."""
MAX_FDS = 4
"""Descriptors one message may carry."""


def send_message(sock: socket.socket, message: tuple, fds: list[int] | None = None) -> None:
    """One message: the length, then the ``marshal`` payload; ``fds`` travel with its first byte."""
    payload = marshal.dumps(message)
    data = HEADER.pack(len(payload)) + payload
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))] if fds else []
    sent = sock.sendmsg([data], anc)
    if sent < len(data):
        sock.sendall(data[sent:])


def receive_message(sock: socket.socket) -> tuple[tuple | None, list[int]]:
    """The next message and the descriptors sent with it; ``(None, [])`` at end of stream.

    A peer that died with answers it had not read yet (a training process killed by a preemption's
    SIGKILL) resets the connection instead of closing it: that is an end of stream too, not an error
    (a traceback in the job's log after every such kill would say nothing useful).
    """
    fds: list[int] = []
    try:
        return _receive(sock, fds)
    except ConnectionResetError:
        for fd in fds:
            os.close(fd)
        return None, []


def _receive(sock: socket.socket, fds: list[int]) -> tuple[tuple | None, list[int]]:
    head = b""
    while len(head) < HEADER.size:
        data, anc, _flags, _addr = sock.recvmsg(HEADER.size - len(head), socket.CMSG_SPACE(MAX_FDS * 4))
        for level, kind, blob in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                usable = len(blob) - len(blob) % 4
                fds.extend(struct.unpack(f"{usable // 4}i", blob[:usable]))
        if not data:
            for fd in fds:
                os.close(fd)
            return None, []
        head += data
    (size,) = HEADER.unpack(head)
    body = bytearray(size)
    view = memoryview(body)
    got = 0
    while got < size:
        n = sock.recv_into(view[got:], size - got)
        if n == 0:
            for fd in fds:
                os.close(fd)
            return None, []
        got += n
    return marshal.loads(bytes(body)), fds


__all__ = ["HEADER", "MAX_FDS", "receive_message", "send_message"]
