"""Load the package's small C libraries, built at install time, with :mod:`ctypes`.

The C sources (``planes_native.c``, ``upload_native.c``) are compiled by ``pip install`` (``setup.py``
declares them as optional extensions: an install without a C compiler still succeeds) into plain shared
objects next to this module, named like extension modules (``planes_native.cpython-311-x86_64-linux-gnu.so``).
They export C functions only, no ``PyInit``: they are loaded here with ``ctypes.CDLL`` (a call through
ctypes releases the GIL), never imported. A source tree gets them with ``python setup.py build_ext --inplace``.

Nothing is ever compiled in the training process. Where a library is absent (no compiler at install),
fails to load, reports another ABI than its wrapper expects (a stale build), or native code is turned off
(:func:`checkpointd.options.native_enabled`), :meth:`NativeLibrary.get` returns None, :attr:`NativeLibrary.why_not`
says why, and the wrapper's callers run their Python path.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import logging
import threading
from pathlib import Path
from typing import Any, Callable

from checkpointd import options

logger = logging.getLogger("checkpointd")

PACKAGE_DIR = Path(__file__).resolve().parent
"""Where the install puts the built libraries (the folder of this package)."""

BUILD_HINT = "reinstall checkpointd where a C compiler is available, or run `python setup.py build_ext --inplace` in a source tree"


def built_library(folder: Path, stem: str) -> Path | None:
    """The shared object built from ``<stem>.c`` in ``folder``, or None: the first file named ``stem`` plus
    one of this interpreter's extension suffixes (``.cpython-311-x86_64-linux-gnu.so``, ``.abi3.so``, ``.so``)."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = folder / f"{stem}{suffix}"
        if candidate.is_file():
            return candidate
    return None


class NativeLibrary:
    """One C library of the package, loaded on the first :meth:`get`, or None with the reason in
    :attr:`why_not` (its callers then run their Python path).

    ``stem``: the C source's name without ``.c`` (also the built file's stem); ``abi``: the name and value
    of the ``int f(void)`` the source exports, checked at load (a library built from another version of the
    source is never used); ``configure`` declares the functions' ctypes signatures; ``what`` names the
    library in log lines and ``fallback`` ends them, saying what runs instead. ``folder`` is where the built
    file is looked for (tests point it elsewhere).
    """

    def __init__(self, stem: str, abi: tuple[str, int], configure: Callable[[Any], None], what: str, fallback: str,
                 folder: Path = PACKAGE_DIR) -> None:
        self.stem, self.abi, self.configure = stem, abi, configure
        self.what, self.fallback, self.folder = what, fallback, folder
        self.lock = threading.Lock()
        self.loaded: Any = None
        self.tried = False
        self.why_not = ""
        """Why the library is not in use ("" when it is, or before the first try)."""

    def get(self) -> Any:
        """The loaded library (a ``ctypes.CDLL``), or None; loaded on the first call."""
        if not self.tried:
            with self.lock:
                if not self.tried:
                    self.loaded = self.load()
                    self.tried = True
        return self.loaded

    def reset(self) -> None:
        """Forget the loaded state so the next :meth:`get` decides again (tests)."""
        with self.lock:
            self.loaded, self.tried, self.why_not = None, False, ""

    def module_getattr(self, module: str) -> Callable[[str], Any]:
        """A module-level ``__getattr__`` for the module that wraps this library: it serves ``why_not``
        as it is at the time of the call (a plain module attribute keeps its value from import time)."""

        def __getattr__(name: str) -> Any:
            if name == "why_not":
                return self.why_not
            raise AttributeError(f"module {module!r} has no attribute {name!r}")

        return __getattr__

    def load(self) -> Any:
        """Load and check the built library (:meth:`get` calls this once); None with :attr:`why_not` set."""
        if not options.native_enabled():
            self.why_not = f"native code is turned off ({options.NATIVE_ENV}=0)"
            return None
        path = built_library(self.folder, self.stem)
        if path is None:
            self.why_not = f"{self.stem} is not built in {self.folder} ({BUILD_HINT})"
            logger.info("checkpointd: %s for the %s; %s", self.why_not, self.what, self.fallback)
            return None
        name, expected = self.abi
        try:
            lib = ctypes.CDLL(str(path))
            got = getattr(lib, name)()
            if got != expected:
                raise RuntimeError(f"{path} has library ABI {got}, expected {expected} ({BUILD_HINT})")
            self.configure(lib)
        except Exception as exc:  # noqa: BLE001 - any failure means the Python path
            self.why_not = str(exc)
            logger.warning("checkpointd: %s unavailable (%s); %s", self.what, exc, self.fallback)
            return None
        return lib


__all__ = ["BUILD_HINT", "NativeLibrary", "PACKAGE_DIR", "built_library"]
