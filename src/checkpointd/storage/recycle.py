"""Recycling retired checkpoint files: the next save overwrites them instead of allocating new ones.

Why: on a local target, deleting a retired checkpoint's files and creating new ones of the same size
for the next save frees every page of gigabytes on tmpfs and allocates (and zeroes) them again a few
seconds later; on the GPU hosts measured (Firecracker VMs with free page reporting) the freed pages
even go back to the host and come back through its page faults. On an H200 host, 4.3 GB in 8 threads:
a new tmpfs file takes 0.4 s to reserve and 0.45 s to fill, plus 0.23 s to delete; overwriting an
existing one takes 0.07 s and 0.25 s. Writing into pages that exist is also what the rest of the
machine notices least.

How: when retention retires a committed step (marker already removed), its large files are moved
into the bin (:mod:`checkpointd.storage.recyclebin`, ``<root>/.checkpointd-recycle/``) instead of being
deleted (:class:`Retirement`); the rest of the directory is deleted. A save creating a large local
file renames a retired one to its path first (:func:`take`) and writes over it;
:func:`checkpointd.storage.ptlayout.write_file` sets the exact size. The bin holds at most what one save
writes: each retirement first deletes what the previous one left unused, and files beyond the size of
the step just committed are deleted. The bin's module says what keeps this safe.

A recycled file sits in a step directory that has no commit marker while the new save's bytes are
written and checksummed: a crash midway leaves an uncommitted leftover, as with a new file.
``close()`` empties the bin; a bin left by a crash is used (or emptied) by the next run's saves, or
emptied by ``checkpointd gc`` (a running job then just writes its next save into new files).

:func:`checkpointd.options.recycle_enabled` turns recycling off (files are deleted, new ones created).

A run's first saves have nothing retired to write over, so blank files for them are made ahead, in the
background, like the pinned staging buffers (:class:`checkpointd.storage.filesahead.FilesAhead`).

This module holds the retirement pass and gathers the public names of the bin and of the files made
ahead.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

from checkpointd.storage import localpaths
from checkpointd.storage import recyclebin

class Retirement:
    """One retention pass: moves the large files of retired steps into the bin, up to ``budget`` bytes.

    ``budget`` is the size of the large files of the step just committed (what the next save will
    need) times :data:`RETIRE_SLACK`; whatever the previous pass left in the bin is deleted first.
    Step directories are walked and files moved by descriptor, never through a link: a step directory
    that is a link retires nothing, and with a bin that is a link (or not a directory) nothing is moved.
    """

    def __init__(self, store: Any, just_committed_dir: str) -> None:
        self.dir = recyclebin.bin_dir(store)
        self.store = store
        self.budget = int(sum(size for _, _, size in self._large_files(just_committed_dir, close=True)) * RETIRE_SLACK)
        self.recycled_bytes = 0
        fd = recyclebin.open_bin(self.dir)  # made only when a step is retired
        if fd is not None:
            recyclebin.clear_bin(fd)

    def _large_files(self, step_dir: str, close: bool = False) -> list[tuple[int, str, int]]:
        try:
            root_fd = localpaths.open_dir_below(self.store.path(""), [])
        except OSError:
            return []
        try:
            found = recyclebin.large_files_at(root_fd, step_dir)
        except OSError:
            found = []
        finally:
            os.close(root_fd)
        if close:
            for fd in {fd for fd, _, _ in found}:
                os.close(fd)
        return found

    def retire(self, step_dir: str) -> None:
        """Move ``step_dir``'s large files into the bin (within budget); the caller deletes the rest."""
        found = self._large_files(step_dir)
        bin_fd = None
        try:
            for dir_fd, path, size in sorted(found, key=lambda e: -e[2]):
                if self.recycled_bytes + size > self.budget:
                    continue
                if bin_fd is None:
                    bin_fd = recyclebin.open_bin(self.dir, create=True)
                    if bin_fd is None:
                        return
                name = uuid.uuid4().hex
                checking = name + recyclebin.CHECKING_SUFFIX  # not taken under this name
                try:
                    os.rename(path, checking, src_dir_fd=dir_fd, dst_dir_fd=bin_fd)
                except OSError:
                    continue
                # Renamed first, so no new opener finds it by its old name; then refused if anyone has it
                # (or it has another link); only then under a name that savers take.
                try:
                    if not recyclebin.exclusive(bin_fd, checking):
                        raise OSError("in use")
                    os.rename(checking, name + recyclebin.READY_SUFFIX, src_dir_fd=bin_fd, dst_dir_fd=bin_fd)
                except OSError:
                    recyclebin.unlink_at(bin_fd, checking)
                    continue
                self.recycled_bytes += size
        finally:
            if bin_fd is not None:
                os.close(bin_fd)
            for fd in {fd for fd, _, _ in found}:
                os.close(fd)


RETIRE_SLACK = 1.1
"""A retirement keeps up to this much more than the step just committed wrote. Why: compressed files of
consecutive saves differ by a little; with a budget of exactly the committed bytes, a retired file 0.1 %
larger than its successor would be deleted instead of recycled, and every zstd save would write a new file."""


__all__ = ["RETIRE_SLACK", "Retirement"]
