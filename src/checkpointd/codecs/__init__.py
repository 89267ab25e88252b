"""Bytes between the serializer and storage: checksums and compression.

- ``crc.py``, ``checksum.py``     CRC-32 of streamed bytes and the combination of adjacent ranges' CRCs
- ``compress.py``                 the codecs (``none``, ``zstd``, ``zstd-planes``), chunked, multi-threaded
- ``container.py``, ``reader.py`` the chunked container's seek table, and reading chunks in parallel
- ``planes.py``, ``plane_kernels.py``, ``zstd_frames.py``  the byte-plane chunk format, its kernels,
  per-thread zstd contexts
"""
