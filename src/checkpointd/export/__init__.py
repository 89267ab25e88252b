"""``checkpointd export``: a committed step written out for other tools.

- ``formats.py``      :func:`export_step`: the one entry point, ``format="native" | "dcp" | "safetensors"``
- ``native.py``       native uncompressed PhysicsNeMo-style files (``torch.load``, ``load_checkpoint``)
- ``dcp.py``          a ``torch.distributed.checkpoint`` directory (``dcp.load``)
- ``safetensors.py``  each nn.Module's weights as ``<entry>.safetensors`` (``safetensors.torch.load_file``)
- ``values.py``       a step's whole values (sharded steps assembled), shared by dcp and safetensors
- ``result.py``       :class:`ExportedFile`, what every format reports
"""

from checkpointd.export.dcp import export_dcp
from checkpointd.export.formats import FORMATS, export_step
from checkpointd.export.native import export_native, native_name
from checkpointd.export.result import ExportedFile
from checkpointd.export.safetensors import export_safetensors, safetensors_file_names

__all__ = ["FORMATS", "ExportedFile", "export_dcp", "export_native", "export_safetensors", "export_step",
           "native_name", "safetensors_file_names"]
