"""Optional native code: C libraries built at install and loaded with ctypes (:mod:`~checkpointd.native.loader`,
:mod:`~checkpointd.native.planes`, :mod:`~checkpointd.native.upload`), and CUDA kernels compiled with NVRTC
and cached per machine (:mod:`~checkpointd.native.cuda_rtc`, :mod:`~checkpointd.native.kernel_cache`)."""
