"""The core's tensor interface on each framework, importable without Horovod.

:mod:`dgc_horovod.backends.torch_backend` (``TorchBackend``, CPU or CUDA tensors) and
:mod:`dgc_horovod.backends.tf_backend` (``TFBackend``, eager TensorFlow) implement
:class:`dgc_horovod.core.backend.Backend`; the NumPy reference is in the core.
:mod:`dgc_horovod.backends.triton_engine` is the engine for CUDA tensors (Triton kernels, on
torch; :mod:`dgc_horovod.core.engine`). Nothing here
imports Horovod, so the core and its backends run where Horovod is not installed (a GPU box, the
simulated cluster of :mod:`dgc_horovod.simulate`).
"""
