"""Restore: a committed step back into the live objects, verified before anything is parsed.

- ``step.py``            one step: manifest -> verified reads -> decoded trees -> applied in place
- ``fastload.py``        local files: parallel verified reads into one buffer, tensors built on it
- ``device_image.py``, ``device_crc.py``  files mapped, uploaded whole to the GPU and checksummed there
- ``apply.py``, ``per_entry.py``, ``bulkcopy.py``, ``bounce.py``  stored values into live tensors: bulk
  copies first, host-to-device through pinned chunks
- ``verify.py``, ``checkpoint_file.py``, ``partial.py``  verification (also ``checkpointd verify``),
  and reading single tensors of a large file
- ``assemble.py``        sharded checkpoints merged into full tensors (``checkpointd.load``)
"""
