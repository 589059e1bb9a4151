"""Helpers shared by the test modules: conversions between NumPy and the backends' tensors, and
the batch-path tests' bit-exact comparisons.

No framework is imported here at import time (torch and TensorFlow are imported where a helper
needs them), so any test module, and the child processes some tests start, can import it.
(Launching `horovodrun` jobs is in conftest.py.)
"""
import numpy as np

F32 = np.float32


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


# ---------------------------------------------------------------- the batch-path tests (test_batch.py)
def raw(x):
    """Bit-exact identity of a tensor (dtype, shape, bytes: NaN payloads and -0.0 included)."""
    a = to_np(x)
    return None if a is None else (a.dtype.str, a.shape, a.tobytes())


def same_gen(core_a, core_b):
    """Whether two DGCCores' random generators are in the same state."""
    a, b = (c.B.generator_state(c._generator) for c in (core_a, core_b))
    if hasattr(a, "detach"):                              # torch.Tensor
        import torch
        return torch.equal(a, b)
    if hasattr(a, "numpy"):                               # tf.Tensor
        return np.array_equal(a.numpy(), b.numpy())
    return a == b


def convert(backend, a, kind=""):
    """float32 ndarray a as the backend's gradient of `kind` (same values up to the dtype)."""
    a = np.asarray(a, dtype=F32)
    if backend == "numpy":
        if kind == "f64":
            return a.astype(np.float64)
        if kind == "f16":
            return a.astype(np.float16)
        if kind == "be":
            return a.astype(">f4")                                  # big-endian float32
        if kind == "T" and a.ndim == 2:
            return np.asfortranarray(a)
        if kind == "strided":
            return np.repeat(a.reshape(-1), 2)[::2].reshape(a.shape)
        return a.copy()
    import torch
    t = torch.from_numpy(a.copy())
    if kind == "f16":
        return t.half()
    if kind == "bf16":
        return t.bfloat16()
    if kind == "f64":
        return t.double()
    if kind == "T" and t.dim() == 2:
        return t.t().contiguous().t()
    if kind == "strided":
        return torch.from_numpy(np.repeat(a.reshape(-1), 2))[::2].reshape(a.shape)
    return t
