"""Build the package's C libraries at install time (everything else is in ``pyproject.toml``).

``planes_native.c`` with ``planes_encode.c`` (the byte-plane codec's kernels) and ``upload_native.c`` (GPU
uploads without the GIL) are built as plain shared objects next to the modules that load them with ctypes
(:mod:`checkpointd.native.loader`); they need no Python or CUDA headers. Both are optional: an install
without a C compiler succeeds, and the NumPy / Python paths run instead. In a source tree,
``python setup.py build_ext --inplace`` builds them in place (``pip install -e .`` does that itself).
"""

from setuptools import Extension, setup

NATIVE = "src/checkpointd/native"

setup(
    ext_modules=[
        Extension("checkpointd.native.planes_native", [f"{NATIVE}/planes_native.c", f"{NATIVE}/planes_encode.c"],
                  extra_compile_args=["-O3", "-std=gnu99"], libraries=["m"],
                  depends=[f"{NATIVE}/planes_native.h"], optional=True),
        Extension("checkpointd.native.upload_native", [f"{NATIVE}/upload_native.c"],
                  extra_compile_args=["-O3", "-std=gnu11", "-pthread"], extra_link_args=["-pthread"], optional=True),
    ],
)
