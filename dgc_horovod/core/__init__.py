"""The framework-agnostic DGC core: no torch, tensorflow or horovod import in this package.

Files follow one gradient: :mod:`accumulate` (clipping, momentum correction, masking) →
:mod:`sparsify` (the top-k rule and its sampling) → :mod:`wire` (encode / decode) →
:mod:`compressor` (the per-worker algorithm; each tensor's state in :mod:`state`) and
:mod:`driver` (a bucket's steps around an engine), with :mod:`engine` (the engine contract and
the reference engine on tensor ops; the C kernels' glue in :mod:`c_engine`), :mod:`warmup`
(sparsity schedule), :mod:`precision` (loss scaling, float16 wire values), :mod:`stats` (the
counters and their recorder), :mod:`checkpoint` (the state dict and its checks) and
:mod:`backend` (the tensor interface, and its NumPy implementation).
"""
from dgc_horovod.core.backend import Backend, NumpyBackend
from dgc_horovod.core.compressor import DGCCore, PLACEHOLDER_BYTES
from dgc_horovod.core.config import DGCConfig
from dgc_horovod.core.stats import CompressionStats
from dgc_horovod.core.warmup import density_at
from dgc_horovod.core.wire import WireFormatError

__all__ = ["Backend", "NumpyBackend", "DGCCore", "DGCConfig", "CompressionStats", "density_at",
           "WireFormatError", "PLACEHOLDER_BYTES"]
