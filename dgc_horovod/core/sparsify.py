"""Top-k selection by magnitude, exact or with a sampled threshold (Lin et al. 2018, §5)."""
import math

import numpy as np

__all__ = ["is_sparse", "k_for", "sample_count", "threshold_rank", "settle", "select_topk",
           "select_above", "sample_positions", "MIN_SAMPLES", "SAMPLE_OVERSHOOT", "TOPK", "KEEP",
           "FALLBACK"]

#: Fewest entries sampled for the threshold estimate (below that the estimate is noise).
MIN_SAMPLES = 64
#: The sampled threshold aims at this many times k candidates, so that usually count ≥ k and the
#: exact top-k can be taken among the candidates.
SAMPLE_OVERSHOOT = 1.25


def is_sparse(numel, ndim, config):
    """The one rule for which tensors are sparsified (top-k selected, residual kept): at least
    ``config.min_sparse_numel`` elements and ``config.min_sparse_ndim`` dimensions. The others
    (by default biases and normalisation scales, as in the authors' reference code, which
    sparsifies only tensors with more than one dimension) go through the dense allreduce as
    their momentum-corrected velocity."""
    return numel >= config.min_sparse_numel and ndim >= config.min_sparse_ndim


def k_for(numel, density):
    """Number of elements to send: max(1, ceil(density · numel)), at most numel."""
    return min(numel, max(1, math.ceil(density * numel - 1e-9)))


def sample_count(n, k, sample_ratio, exact=False):
    """s, the number of entries the threshold estimate of :func:`select_topk` samples for a tensor
    of n elements and target count k: max(MIN_SAMPLES, ceil(sample_ratio · n)), at most n; 0 when
    it does not sample (exact mode, or k ≥ n/2: an exact top-k then)."""
    if exact or k * 2 >= n:
        return 0
    return min(n, max(MIN_SAMPLES, math.ceil(sample_ratio * n)))


def threshold_rank(n, k, s):
    """ks, the rank of the sampled threshold among the s sampled magnitudes of a tensor of n
    elements with target count k (§5): ceil(SAMPLE_OVERSHOOT · k · s / n), in [1, s]. Aiming at
    1.25·k candidates makes count ≥ k, hence the exact top-k, the usual case."""
    return min(s, max(1, math.ceil(SAMPLE_OVERSHOOT * k * s / n)))


#: The settle rule's outcomes (:func:`settle`).
TOPK, KEEP, FALLBACK = "topk", "keep", "fallback"


def settle(count, k):
    """The settle rule of the sampled selection (§5), for ``count`` candidates (entries with
    |v| ≥ the sampled threshold) and target count k: :data:`TOPK` when count > k (the candidates
    hold every true top-k entry: take the exact top-k among them), :data:`KEEP` when
    k/2 ≤ count ≤ k (they are the top-count), :data:`FALLBACK` when count < k/2 (an exact top-k
    over v). The one home of the rule in Python: :func:`select_above`, the fused path's
    :func:`~dgc_horovod.core.kernels.select_rest` and the bucket path
    (:mod:`~dgc_horovod.core.bucket_ops`) call it; the C kernels apply the same rule."""
    if count > k:
        return TOPK
    return FALLBACK if 2 * count < k else KEEP


def sample_positions(u, n):
    """The positions the threshold estimate samples: ``min(floor(u · n), n − 1)`` for float64
    uniform draws u in [0, 1) (NumPy array; each backend's ``sample`` and the C kernels compute the
    same, with u · n rounded once in float64), i.e. uniform over [0, n) with replacement.

    All s draws of a tensor come from one ``generator`` call of s float64 uniforms, so the
    kernels can draw a whole bucket's samples in one call and get the same positions as one call
    per tensor. Returns an int64 array of u's shape. (The NumPy backend's sample() calls it; the
    PyTorch and TensorFlow backends compute the same with their own ops.)
    """
    pos = (np.asarray(u, dtype=np.float64) * n).astype(np.int64)
    return np.minimum(pos, n - 1)


def select_topk(B, v, k, sample_ratio=0.01, exact=False, generator=None):
    """Choose the entries of v to send: its k largest magnitudes, skipping zeros.

    Sampled mode (default; §5 of the paper estimates the threshold on a 0.1–1% sample):

    1. draw s = max(MIN_SAMPLES, ceil(sample_ratio · n)) entries uniformly (with replacement, at
       :func:`sample_positions` of s float64 uniforms from ``generator``) and
       take as threshold their ceil(1.25 · k · s / n)-th largest magnitude;
    2. candidates = entries with |v| ≥ threshold (one pass over v), count c;
    3. c ≥ k: the candidates contain every true top-k entry, so an exact top-k among them gives
       exactly the top-k of v; k/2 ≤ c < k: keep the c candidates (they are the top-c);
       c < k/2: fall back to an exact top-k over v.

    The count therefore always lies in the band [min(ceil(k/2), nnz), min(k, nnz)] (nnz = non-zero
    entries), and equals k (the exact top-k) unless the estimate overshot. Exact mode runs top-k
    over v directly. Zero entries are never sent (an all-zero v selects nothing).

    Args:
        B: backend. v (flat float32 tensor, n elements): the accumulated velocity.
        k (int): target count, 1 ≤ k ≤ n.
        sample_ratio (float): in (0, 1]. exact (bool). generator: backend random generator.

    Returns:
        int64 index tensor of the selected positions (unordered, unique), shape (count,).
    """
    n = B.numel(v)
    mag = B.abs(v)
    s = sample_count(n, k, sample_ratio, exact)
    if not s:
        idx = B.topk_indices(mag, k)
        return B.drop_zeros(idx, B.take(mag, idx))
    threshold = B.kth_largest(B.sample(mag, s, generator), threshold_rank(n, k, s))
    return select_above(B, mag, k, threshold)


def select_above(B, mag, k, threshold):
    """Steps 2–3 of :func:`select_topk`: the candidates mag ≥ threshold, settled to at most k
    (:func:`settle`), zeros dropped. mag: flat float32 magnitudes |v| (read only). Returns the
    int64 index tensor (unordered, unique)."""
    idx = B.indices_where_ge(mag, threshold)
    rule = settle(B.numel(idx), k)
    if rule == TOPK:
        idx = B.take(idx, B.topk_indices(B.take(mag, idx), k))
    elif rule == FALLBACK:
        idx = B.topk_indices(mag, k)
    return B.drop_zeros(idx, B.take(mag, idx))
