"""Storage: the few primitives the pipeline needs, over local disk and any fsspec filesystem.

- ``store.py``, ``writers.py``, ``writerbase.py``, ``s3writer.py``  the ``Store`` and its writers
  (durable local files, parallel S3 multipart uploads); ``retry.py`` retries transient errors
- ``localpaths.py``      paths below a local root opened without following links
- ``ptlayout.py``, ``ziplayout.py``, ``writemode.py``, ``iopool.py``  ``.pt``/``.mdlus`` files written
  with positional writes from many threads, by precomputed zip layout
- ``persist_process.py``, ``persist_process_main.py``, ``persist_protocol.py``, ``persist_mappings.py``,
  ``sharedmem.py``, ``sharedpieces.py``  the persist process: it writes staged bytes from shared memory
- ``recycle.py``, ``recyclebin.py``, ``filesahead.py``  retired files reused by later saves, blank files
  made ahead
- ``fsinfo.py``, ``pagemem.py``, ``lanes.py``, ``serial_worker.py``  filesystem kinds, page population,
  bounded thread lanes, an in-order worker thread
"""
