"""Which backend the TensorFlow adapter's core runs on, and the conversions at its edge.

DGC's per-step work runs eagerly inside the ``tf.py_function`` ops that
:class:`dgc_horovod.tensorflow.DGC` places in the traced step. Where TensorFlow sees no GPU, the
gradients given to those ops are host tensors, so the core runs on the NumPy backend and so on the
fused C kernels (:mod:`dgc_horovod.core.kernels`): one call per tensor for accumulate → select →
encode, one for decode → sum → average, as PyTorch on a CPU does. Eager TensorFlow ops (the
tensor-op path, :class:`~dgc_horovod.backends.tf_backend.TFBackend`) cost dozens of op dispatches
per tensor per step: ``examples/tensorflow2_mnist.py`` ran 4.9× the wall time of dense training
on them (docs/performance.md). Where TensorFlow sees a GPU, the core stays on ``TFBackend``, so
gradients are not copied to the host.

On the NumPy backend the state (u, v, the weight-decay momentum) is held in NumPy arrays, and
:meth:`DGC.state_dict` returns NumPy arrays (picklable as they are).
"""
import warnings

import numpy as np
import tensorflow as tf

from dgc_horovod.backends.tf_backend import TFBackend
from dgc_horovod.core.backend import NumpyBackend

__all__ = ["make_backend", "Host", "check_traced"]


def make_backend(device=None):
    """NumpyBackend (the C kernels) when TensorFlow sees no GPU, else TFBackend.

    device: "cpu" or "gpu" to force the choice (tests); None: decide from
    ``tf.config.list_logical_devices("GPU")``."""
    if device is None:
        device = "gpu" if tf.config.list_logical_devices("GPU") else "cpu"
    if device not in ("cpu", "gpu"):
        raise ValueError(f"DGC: device must be 'cpu', 'gpu' or None, got {device!r}")
    return NumpyBackend() if device == "cpu" else TFBackend()


def check_traced(tensor):
    """The checks of a gradient handed to ``DGC.compress`` that need nothing else: a TypeError
    for a non-floating gradient; a RuntimeError that says what to change when the reduction is
    traced for XLA (``tf.function(jit_compile=True)``): DGC's per-step work runs in
    ``tf.py_function`` ops, which XLA cannot compile (TensorFlow's own error names neither DGC
    nor the fix)."""
    if not tensor.dtype.is_floating:
        raise TypeError(f"DGC: gradients must be floating-point tensors, got {tensor.dtype}")
    try:
        from tensorflow.python.ops.control_flow_util import GraphOrParentsInXlaContext
    except ImportError:         # a TensorFlow without this helper: its own error remains
        return
    if GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
        raise RuntimeError(
            "DGC cannot run under tf.function(jit_compile=True): its per-step work runs in "
            "tf.py_function ops, which XLA cannot compile. Drop jit_compile=True from the "
            "function that calls the DistributedGradientTape's gradient() (or Keras' "
            "model.compile(jit_compile=...))")


class Host:
    """The conversions between TensorFlow's tensors and the core's backend B."""

    def __init__(self, B):
        self.B = B
        self.numpy = isinstance(B, NumpyBackend)

    def dtype(self, tensor):
        """The dtype to hand ``tensor`` to the core in: float32 for the NumPy backend (what the
        core computes in anyway; NumPy has no bfloat16), its own dtype otherwise."""
        return tf.float32 if self.numpy else tensor.dtype

    def __call__(self, t):
        """An eager tensor as the core's tensor: on the NumPy backend a read-only NumPy view of
        its memory (no copy; the core only reads gradients and received payloads). What the core
        returns to ``tf.py_function`` is copied by TensorFlow into a new tensor."""
        return np.asarray(t) if self.numpy else t

    def portable(self, state_dict, current):
        """``state_dict`` as this backend loads it: tensors as NumPy arrays on the NumPy backend;
        a generator state this backend can restore: a state saved on the
        other TensorFlow backend (NumPy vs TensorFlow generator) is replaced by ``current`` (this
        DGC's generator state), with a warning. The generator only draws the samples of the
        threshold estimate (§5), so residuals and momentum load exactly; the resumed run is not
        bit-identical to an uninterrupted one."""
        if not isinstance(state_dict, dict):
            return state_dict
        tensors = state_dict.get("tensors")
        if self.numpy and isinstance(tensors, dict):      # tf.Tensors -> NumPy arrays
            state_dict = dict(state_dict, tensors={
                name: {k: (np.asarray(t) if k in ("u", "v", "wd") and t is not None else t)
                       for k, t in entry.items()} if isinstance(entry, dict) else entry
                for name, entry in tensors.items()})
        if "generator" not in state_dict:
            return state_dict
        saved_numpy = isinstance(state_dict["generator"], dict)
        if saved_numpy == self.numpy:
            return state_dict
        warnings.warn("DGC: this state_dict's threshold-sampling generator was saved on the "
                      f"{'NumPy' if saved_numpy else 'TensorFlow'} backend and cannot be restored "
                      f"on the {self.B.name} backend (see dgc_horovod.tensorflow.host); the "
                      "generator keeps its current state, the residuals load as saved",
                      RuntimeWarning, stacklevel=3)
        return dict(state_dict, generator=current)
