"""Top-k selection by magnitude, exact or with a sampled threshold (Lin et al. 2018, §5)."""
import math

__all__ = ["k_for", "select_topk", "MIN_SAMPLES", "SAMPLE_OVERSHOOT"]

#: Fewest entries sampled for the threshold estimate (below that the estimate is noise).
MIN_SAMPLES = 64
#: The sampled threshold aims at this many times k candidates, so that usually count ≥ k and the
#: exact top-k can be taken among the candidates.
SAMPLE_OVERSHOOT = 1.25


def k_for(numel, density):
    """Number of elements to send: max(1, ceil(density · numel)), at most numel."""
    return min(numel, max(1, math.ceil(density * numel - 1e-9)))


def select_topk(B, v, k, sample_ratio=0.01, exact=False, generator=None):
    """Choose the entries of v to send: its k largest magnitudes, skipping zeros.

    Sampled mode (default; §5 of the paper estimates the threshold on a 0.1–1% sample):

    1. draw s = max(MIN_SAMPLES, ceil(sample_ratio · n)) entries uniformly (with replacement) and
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
    if exact or k * 2 >= n:
        idx = B.topk_indices(mag, k)
    else:
        s = min(n, max(MIN_SAMPLES, math.ceil(sample_ratio * n)))
        ks = min(s, max(1, math.ceil(SAMPLE_OVERSHOOT * k * s / n)))
        threshold = B.kth_largest(B.sample(mag, s, generator), ks)
        idx = B.indices_where_ge(mag, threshold)
        c = B.numel(idx)
        if c > k:
            idx = B.take(idx, B.topk_indices(B.take(mag, idx), k))
        elif 2 * c < k:
            idx = B.topk_indices(mag, k)
    return B.drop_zeros(idx, B.take(mag, idx))
