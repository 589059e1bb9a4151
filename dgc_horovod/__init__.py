"""dgc_horovod: Deep Gradient Compression (DGC) for Horovod.

Lin, Han, Mao, Wang, Dally, "Deep Gradient Compression: Reducing the Communication Bandwidth for
Distributed Training", ICLR 2018, arXiv:1712.01887.

The framework-agnostic algorithm lives in :mod:`dgc_horovod.core` (no torch, tensorflow or horovod
import); the Horovod ``Compressor`` adapters are :mod:`dgc_horovod.torch` and
:mod:`dgc_horovod.tensorflow`. Importing this package imports neither framework.
"""

__version__ = "0.1.0"

from dgc_horovod.core.config import DGCConfig  # noqa: E402,F401
