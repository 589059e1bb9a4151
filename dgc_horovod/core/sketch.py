"""Clipping like dense training: the reduced gradient's norm from a CountSketch (issue #42).

The paper (§3.2) clips each worker's contribution *before* the exchange, at C·N^(-1/2), because
the norm of the sum is not known until the sum is. That equals a dense clip only when the
workers' gradients are independent noise; where they agree the local rule lets steps up to √N
times longer through (docs/accuracy.md: +2.7% perplexity on the LM with nothing sparsified).
``clip_scope="sketch"`` gives every rank the dense clip factor instead, from a linear sketch of
its gradient that costs one small collective per step (Charikar, Chen, Farach-Colton 2002;
Alon, Matias, Szegedy 1996 for the second moment).

Equations (all tensors of a step, dense and sparsified; ``W`` = :data:`WIDTH`):

* each element i of a tensor named t has a slot b_i in [0, W) and a sign σ_i = ±1 from the
  hash h_i = mix32((key_t + i·GOLDEN) mod 2**32), key_t = mix32(tensor_key(t) ^ SALT):
  b_i = h_i mod W, σ_i = +1 if h_i < 2**31 else −1 (:func:`codes`: c_i = b_i + W·[σ_i = −1]);
* rank k's sketch R_k[b] = Σ_t Σ_{i: b_i = b} σ_i·g_k,t[i] over its tensors with no NaN/Inf
  (float32; :func:`sketch`), the gradient as Horovod hands it (the rank's mean gradient,
  times the loss scale S where there is one);
* the R_k are allgathered and summed in rank order in float64: R = Σ_k R_k, the sketch of
  Σ_k g_k (a sketch is linear); Q = Σ_b R[b]² (bucket order) is an unbiased estimate of
  ‖Σ_k g_k‖² with relative standard deviation at most √(2/W) (:func:`estimate`);
* the reduced gradient Horovod applies is ḡ = (1/N)·Σ_k g_k under ``op=hvd.Average`` and
  Σ_k g_k under ``op=hvd.Sum``, so ‖ḡ‖ ≈ √Q / N (Average) or √Q (Sum); every rank clips its
  gradient by the same s = min(1, C / (‖ḡ‖/S + 1e-6)) (:meth:`DGCCore.clip_scale_of_sketches
  <dgc_horovod.core.compressor.DGCCore.clip_scale_of_sketches>`) before accumulation, so that
  Σ_k s·g_k is the dense ``clip_grad_norm_(C)`` of the reduced gradient up to the estimate's
  error. The threshold is C itself, not C·√N: this is the dense rule, not the paper's.

Every rank gets the same R bit for bit (the same rows, summed in the same order), hence the
same s. Bytes per step: each rank sends W·4 and receives (N − 1)·W·4 (:func:`sketch_bytes`).
Memory: the codes, 4 bytes per element of every tensor, computed once per tensor.
"""
from dgc_horovod.core.sparsify import GOLDEN, _M32, _mul32, mix32, tensor_key

__all__ = ["WIDTH", "SALT", "tensor_sketch_key", "codes", "sketch", "estimate", "sketch_bytes"]

#: W, the sketch's buckets (a power of two): √(2/W) = 6.3% relative standard deviation of the
#: squared norm at most (3.1% of the norm), 2 KB per rank and step.
WIDTH = 512
#: Mixed into each tensor's key so the sketch's hash is not the sampling hash of sparsify.
SALT = 0x5EC7C11B


def tensor_sketch_key(name):
    """key_t: the 32-bit key of tensor ``name``'s slots and signs."""
    return mix32(tensor_key(name) ^ SALT)


def codes(B, name, n, like, width=WIDTH):
    """The codes c_i = b_i + W·[σ_i = −1] of the n elements of tensor ``name`` (int64 tensor
    in [0, 2W), on ``like``'s device): the module docstring's hash."""
    h = mix32((_mul32(B.arange(n, like=like), GOLDEN) + tensor_sketch_key(name)) & _M32)
    return (h & (width - 1)) + (h // 2 ** 31) * width


def sketch(B, entries, like, width=WIDTH):
    """R_k: the float32 sketch (W,) of a rank's gradients. ``entries``: (gradient, codes of
    :func:`codes`) in a fixed order; a gradient with NaN/Inf is left out (as
    :func:`~dgc_horovod.core.accumulate.squared_norm` leaves it out of the norm: it is not
    accumulated at all). Each gradient's entries are added at their codes into 2W float32
    buckets (positive signs in [0, W), negative in [W, 2W)) and R = first half − second half."""
    acc = B.zeros(2 * width, like)
    for g, c in entries:
        g = B.float32_view(g)
        if B.all_finite(g):
            B.index_add_(acc, c, g)
    plus, minus = B.split(acc, [width, width])
    out = B.float32_flat(plus)
    B.add_(out, minus, alpha=-1.0)
    return out


def estimate(rows):
    """Q = Σ_b (Σ_k R_k[b])²: ``rows`` the N sketches (sequences of floats) in rank order,
    summed in float64 in rank order, then squared and summed in bucket order. A Python float
    (inf when a bucket is not finite)."""
    total = None
    for r in rows:
        r = [float(x) for x in r]
        total = r if total is None else [a + b for a, b in zip(total, r)]
    q = 0.0
    for x in total:
        q += x * x
    return q if q == q else float("inf")


def sketch_bytes(world_size, width=WIDTH):
    """(sent, received) bytes per rank and step of the sketch's allgather: W·4, (N − 1)·W·4."""
    return width * 4, (world_size - 1) * width * 4
