"""Build the package's small C libraries with the system compiler, once per machine, into a private cache.

Why a runtime build and not a wheel's extension: checkpointd installs as pure Python (``pip install``
with no build step), and its C parts are optional accelerators with Python fallbacks
(:mod:`checkpointd.native.planes`, :mod:`checkpointd.native.upload`). The first use compiles the
shipped source with ``$CC`` (else ``cc``; ``-O3``, no ``-march``: the result may be shared by different
hosts) into ``$CHECKPOINTD_CACHE_DIR`` (default ``$XDG_CACHE_HOME/checkpointd`` or
``~/.cache/checkpointd``; :mod:`checkpointd.native.kernel_cache`) under a name keyed by the source, the
compiler, the flags and the machine, so every later process just loads it. Writes are atomic (a
temporary file, then a rename), so ranks that start together cannot load a half-written library.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Sequence

from checkpointd.native.kernel_cache import CACHE_DIR_ENV, cache_dir, check_private, private_folders

logger = logging.getLogger("checkpointd")

NATIVE_ENV = "CHECKPOINTD_NATIVE"
"""``0`` turns every C library off (the Python paths run)."""
COMPILE_TIMEOUT_S = 120


def disabled() -> bool:
    return os.environ.get(NATIVE_ENV, "1").strip().lower() in ("0", "false", "no", "off")


def compiler() -> str | None:
    """The C compiler command (``$CC`` or ``cc``) when it is on ``PATH``."""
    cc = os.environ.get("CC") or "cc"
    return shutil.which(cc.split()[0]) and cc


def build(source: bytes, stem: str, cc: str, flags: Sequence[str]) -> Path:
    """The shared library compiled from ``source``: from the cache, or compiled into it now."""
    key = hashlib.sha256(b"\0".join([source, cc.encode(), " ".join(flags).encode(),
                                      platform.machine().encode(), sys.platform.encode()])).hexdigest()[:16]
    last_error: Exception | None = None
    for folder in private_folders():
        target = folder / f"{stem}-{key}.so"
        try:
            if target.is_file():
                check_private(target)
                return target
            with tempfile.TemporaryDirectory(dir=folder) as tmp:
                src = Path(tmp) / f"{stem}.c"
                src.write_bytes(source)
                built = Path(tmp) / f"{stem}.so"
                proc = subprocess.run([*cc.split(), *flags, "-o", str(built), str(src)], capture_output=True,
                                      text=True, timeout=COMPILE_TIMEOUT_S)
                if proc.returncode != 0:
                    raise RuntimeError(f"{cc} failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
                os.chmod(built, 0o755)  # whatever the umask: loadable, writable by this user only
                os.replace(built, target)  # atomic: a concurrent loader sees the old state or all of it
            return target
        except OSError as exc:  # an unwritable or shared folder: try the next
            last_error = exc
    raise RuntimeError(f"no private, writable folder for the compiled kernels ({cache_dir()} or the per-user temporary "
                       f"folder; set {CACHE_DIR_ENV}){': ' + repr(last_error) if last_error else ''}")


class NativeLibrary:
    """One shipped C library, built and loaded on the first :meth:`get`, or None with the reason in
    :attr:`why_not` (its callers then run their Python path).

    ``abi``: the name and value of the ``int f(void)`` the source exports, checked at load (a cached
    library built from another source is never used); ``configure`` declares the functions' ctypes
    signatures; ``fallback`` ends the log line that says what runs instead.
    """

    def __init__(self, source: Path, stem: str, flags: Sequence[str], abi: tuple[str, int],
                 configure: Callable[[Any], None], what: str, fallback: str) -> None:
        self.source, self.stem, self.flags = source, stem, list(flags)
        self.abi, self.configure, self.what, self.fallback = abi, configure, what, fallback
        self._lock = threading.Lock()
        self._loaded: Any = None
        self._tried = False
        self.why_not = ""
        """Why the library is not in use ("" when it is, or before the first try)."""

    def get(self) -> Any:
        """The loaded library (a ``ctypes.CDLL``), or None; built on the first call."""
        if not self._tried:
            with self._lock:
                if not self._tried:
                    self._loaded = self._load()
                    self._tried = True
        return self._loaded

    def reset(self) -> None:
        """Forget the loaded state so the next :meth:`get` decides again (tests)."""
        with self._lock:
            self._loaded, self._tried, self.why_not = None, False, ""

    def module_getattr(self, module: str) -> Callable[[str], Any]:
        """A module-level ``__getattr__`` for the module that wraps this library: it serves ``why_not``
        as it is now (a plain module attribute would keep the value it had when the module was imported)."""

        def __getattr__(name: str) -> Any:
            if name == "why_not":
                return self.why_not
            raise AttributeError(f"module {module!r} has no attribute {name!r}")

        return __getattr__

    def _load(self) -> Any:
        if disabled():
            self.why_not = f"{NATIVE_ENV}=0"
            return None
        cc = compiler()
        if not cc:
            self.why_not = "no C compiler (set CC or install cc)"
            logger.info("checkpointd: %s for the %s; %s", self.why_not, self.what, self.fallback)
            return None
        name, expected = self.abi
        try:
            lib = ctypes.CDLL(str(build(self.source.read_bytes(), self.stem, cc, self.flags)))
            got = getattr(lib, name)()
            if got != expected:
                raise RuntimeError(f"library ABI {got}, expected {expected}")
            self.configure(lib)
        except Exception as exc:  # noqa: BLE001 - any failure means the Python path
            self.why_not = str(exc)
            logger.warning("checkpointd: %s unavailable (%s); %s", self.what, exc, self.fallback)
            return None
        return lib


__all__ = ["NATIVE_ENV", "NativeLibrary", "build", "compiler", "disabled"]
