"""Helpers shared by the test modules: conversions between NumPy and the backends' tensors, and
bit-exact comparisons.

No framework is imported here at import time (torch and TensorFlow are imported where a helper
needs them), so any test module, and the child processes some tests start, can import it.
(Launching `horovodrun` jobs is in conftest.py.)
"""
import numpy as np


def to_np(x):
    """A NumPy copy of a NumPy array, a torch tensor, or a TensorFlow tensor / variable (None
    stays None)."""
    if x is None:
        return None
    if hasattr(x, "detach"):                              # torch.Tensor
        x = x.detach().cpu().contiguous()
    if hasattr(x, "numpy"):                               # torch.Tensor, tf.Tensor, tf.Variable
        x = x.numpy()
    return np.array(x, copy=True)


def to_backend(B, a):
    """A copy of array `a` as backend B's tensor (tf.constant, torch tensor or ndarray)."""
    a = np.array(a, copy=True)
    if B.name == "tensorflow":
        import tensorflow as tf
        return tf.constant(a)
    if B.name == "torch":
        import torch
        return torch.from_numpy(a)
    return a


# ---------------------------------------------------------------- bit-exact comparisons
def raw(x):
    """Bit-exact identity of a tensor (dtype, shape, bytes: NaN payloads and -0.0 included)."""
    a = to_np(x)
    return None if a is None else (a.dtype.str, a.shape, a.tobytes())
