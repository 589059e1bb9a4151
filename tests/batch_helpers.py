"""Helpers of the batch-path tests (test_batch.py)."""
import numpy as np
import pytest
import torch

F32 = np.float32


@pytest.fixture(autouse=True)
def restore_torch_threads():
    """Every test leaves torch's intra-op thread count as it found it (import it into a test
    module to apply it there)."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def to_np(x):
    """A NumPy copy of a NumPy or torch tensor (None stays None)."""
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().contiguous().numpy().copy()
    return np.array(x, copy=True)


def raw(x):
    """Bit-exact identity of a tensor (dtype, shape, bytes: NaN payloads and -0.0 included)."""
    a = to_np(x)
    return None if a is None else (a.dtype.str, a.shape, a.tobytes())


def same_gen(core_a, core_b):
    """Whether two DGCCores' random generators are in the same state."""
    a, b = (c.B.generator_state(c._generator) for c in (core_a, core_b))
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


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
