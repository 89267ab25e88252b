"""``export_step``: one entry point for every export format, as the ``--format`` option names them."""

from __future__ import annotations

from collections.abc import Callable

from checkpointd.errors import ConfigError
from checkpointd.export.dcp import export_dcp
from checkpointd.export.native import export_native
from checkpointd.export.result import ExportedFile
from checkpointd.export.safetensors import export_safetensors
from checkpointd.storage.store import Store

__all__ = ["FORMATS", "export_step"]

FORMATS = {"native": export_native, "dcp": export_dcp, "safetensors": export_safetensors}
"""``--format`` values: native uncompressed PhysicsNeMo-style files (the default), a
``torch.distributed.checkpoint`` directory, model weights as ``.safetensors`` files."""


def export_step(store: Store, step_dir: str, out: Store, *, format: str = "native", overwrite: bool = False,
                on_bytes: Callable[[int], None] | None = None, dequantize: bool = False) -> list[ExportedFile]:
    """Export the committed step ``step_dir`` of ``store`` into ``out`` in ``format`` (see :data:`FORMATS`).

    Every format verifies each file against the manifest before using it and parses pickles with the
    weights-only unpickler; see :func:`~checkpointd.export.native.export_native`,
    :func:`~checkpointd.export.dcp.export_dcp` and :func:`~checkpointd.export.safetensors.export_safetensors`.

    ``dequantize`` (dcp and safetensors): tensor subclasses written as plain dequantized tensors, not
    bit-exact; native files always hold them exactly.

    Raises:
        ConfigError: an unknown ``format``, ``dequantize`` with ``format="native"``, or what the format's
            function raises for its output.
    """
    try:
        run = FORMATS[format]
    except KeyError:
        raise ConfigError(f"unknown export format {format!r}; choose one of {', '.join(FORMATS)}") from None
    if format == "native":
        if dequantize:
            raise ConfigError("--dequantize applies to --format dcp and safetensors; native files hold tensor "
                              "subclasses exactly (load them with checkpointd.load(..., dequantize=True))")
        return run(store, step_dir, out, overwrite=overwrite, on_bytes=on_bytes)
    return run(store, step_dir, out, overwrite=overwrite, on_bytes=on_bytes, dequantize=dequantize)
