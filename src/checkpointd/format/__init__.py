"""What a checkpoint is on disk, independent of how it is written or read.

- ``layout.py``     names: step directories, file names, the manifest and the commit marker
- ``manifest.py``   the manifest (versioned JSON) and its strict validation
- ``serialize.py``  a state tree -> a ``.pt`` file that ``torch.load(weights_only=True)`` reads
- ``mdlus.py``      PhysicsNeMo ``.mdlus`` files, written and read without importing PhysicsNeMo
- ``sharding.py``   records of DTensor shards (global shape, offsets, placements, mesh)
- ``streams.py``    small file-like adapters shared by writers and readers
"""
