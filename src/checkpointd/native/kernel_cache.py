"""Where checkpointd keeps the CUDA kernels it compiles with NVRTC (:mod:`checkpointd.native.cuda_rtc`):
private folders only.

Why: a cached cubin is loaded and run in the training process, so a file someone else could have written
must never be used. The folder is :func:`checkpointd.options.cache_dir` (default
``$XDG_CACHE_HOME/checkpointd`` or ``~/.cache/checkpointd``), else a per-user folder in the temporary
directory; a folder or file owned by another user, or writable by group or others, is refused.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Iterator

from checkpointd import options

def check_private(path: Path) -> None:
    """Refuse code that someone else could have put there: owned by another user, or writable by others."""
    st = path.stat()
    if hasattr(os, "getuid") and (st.st_uid != os.getuid() or st.st_mode & 0o022):
        raise PermissionError(f"{path} is not private to this user (owner {st.st_uid}, mode {st.st_mode & 0o777:o})")


def private_folders() -> Iterator[Path]:
    """The cache folder, then the per-user temporary one, each made (mode 0700) and checked before it is
    yielded; a folder that cannot be made or is not private is skipped."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    for folder in (options.cache_dir(), Path(tempfile.gettempdir()) / f"checkpointd-{uid}"):
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            check_private(folder)
        except OSError:
            continue
        yield folder


__all__ = ["check_private", "private_folders"]
