"""The compress steps over a bucket, on tensor ops: O(1) backend calls per bucket, not per tensor.

The tensor-op twin of the batch kernel (:class:`~dgc_horovod.core.kernels.Batch`, which runs on
host memory): CUDA and TensorFlow tensors and ``DGCCore.use_kernels = False`` run it from
:meth:`DGCCore.compress_many <dgc_horovod.core.compressor.DGCCore.compress_many>`. A bucket is the
unit: the u and v of its sparsified tensors live in one flat float32 buffer each
(:class:`FlatState`; each tensor's u and v are views of a segment of them, segments aligned to
blocks of :data:`BLOCK` elements), so every step is a few backend calls over the whole bucket,
and the per-tensor quantities (k, sample counts, thresholds, candidate counts) are short lists.
In the order they run (:func:`compress`):

1. accumulate (§3.1, eq. 5–6): :func:`~dgc_horovod.core.accumulate.momentum_correction` over the
   flat buffers (the gradients concatenated, padded alike);
2. threshold (§5): :func:`sampled_thresholds`, every segment's sampled threshold (one generator
   call and one sort for the bucket);
3. candidates and settle (§5): :func:`select` (:func:`candidates`: block maxima of |v| against
   the thresholds, then only the blocks that reach them; the rule of
   :func:`~dgc_horovod.core.sparsify.settle` per segment);
4. mask (§3.2): :func:`~dgc_horovod.core.accumulate.clear_sent` on the flat buffers;
5. encode: :func:`~dgc_horovod.core.wire.encode_many`, every payload at once.

Same results, bit for bit, as one ``DGCCore.compress`` per tensor on tensor ops (and so as the C
kernels): the arithmetic is elementwise (the same on a segment as on a tensor), the sample draws
of all segments are one generator call (the same values as one per tensor, see
:func:`~dgc_horovod.core.sparsify.sample_positions`), and the selected set is the one
:func:`~dgc_horovod.core.sparsify.select_topk` selects whenever it is unique; a segment where it
is not (a tie at the k-th magnitude, too few candidates, NaN) is settled by
:func:`~dgc_horovod.core.sparsify.select_above` / the backend's top-k on that segment alone, as
the C kernels leave such a tensor to the backend. Covers the default wire format (``delta16``
indices, float32 values); the core runs the others one tensor at a time.
"""
import struct
from itertools import accumulate

from dgc_horovod.core import wire
from dgc_horovod.core.accumulate import clear_sent, momentum_correction
from dgc_horovod.core.sparsify import (KEEP, TOPK, k_for, sample_count, select_above,
                                       settle, threshold_rank)

__all__ = ["FlatState", "sampled_thresholds", "select", "compress", "NAN_BITS"]

#: float32 bit pattern of the threshold of a segment that selects nothing by comparison (NaN:
#: no magnitude is >= it).
NAN_BITS = 0x7FC00000
_SEG = 1 << 32          # a segment's weight in a sort key: segment · 2**32 + magnitude bits


def _f32(bits):
    """The float32 value of a bit pattern, as a Python float (exact)."""
    return struct.unpack("<f", struct.pack("<I", bits))[0]


#: Each segment of a bucket's flat buffers starts at a multiple of BLOCK elements (the gaps hold
#: zeros), so that the buffers cut into blocks of BLOCK elements of one tensor each.
BLOCK = 64


class FlatState:
    """The u and v of a bucket's sparsified tensors as one flat float32 buffer each.

    Attributes: names (tuple), sizes (list of numel), offsets (list: where each segment starts,
    a multiple of :data:`BLOCK`; the last entry is the buffers' length), u (flat buffer, None
    with momentum 0), v; views (bool): whether each tensor's st.u / st.v are views of u / v
    (NumPy, torch). A backend without views (TensorFlow, whose state is in tf.Variables) keeps
    each tensor's own u and v, and :meth:`load` / :meth:`store` copy them into the buffers and
    back around each call. The gaps between segments stay zero (the gradient is padded with
    zeros alike), so they are never selected.
    """

    __slots__ = ("names", "sizes", "offsets", "u", "v", "views", "_us", "_vs")

    def __init__(self, B, sts):
        self.names = tuple(st.name for st in sts)
        self.sizes = [st.numel for st in sts]
        self.offsets = list(accumulate((-(-n // BLOCK) * BLOCK for n in self.sizes), initial=0))
        self.u = None if sts[0].u is None else B.float32_flat(B.flat_cat([st.u for st in sts],
                                                                          BLOCK))
        self.v = B.float32_flat(B.flat_cat([st.v for st in sts], BLOCK))
        vs = B.flat_views(self.v, self.offsets, self.sizes)
        self.views = vs is not None
        self._us = self._vs = None
        if self.views:               # the tensors' state becomes the segments of the buffers
            us = ([None] * len(sts) if self.u is None
                  else B.flat_views(self.u, self.offsets, self.sizes))
            for st, u, v in zip(sts, us, vs):
                st.u, st.v, st.plan = u, v, None
            self._us, self._vs = us, vs

    def holds(self, sts):
        """True while sts (the same tensors, in order) still have their state in the buffers
        (nothing replaced it: a checkpoint load, another bucket)."""
        if len(sts) != len(self.names):
            return False
        if not self.views:
            return all(st.name == n and st.numel == s
                       for st, n, s in zip(sts, self.names, self.sizes))
        return all(st.u is u and st.v is v for st, u, v in zip(sts, self._us, self._vs))

    def load(self, B, sts):
        """Without views: copy the tensors' u and v into the buffers."""
        if not self.views:
            for flat, attr in ((self.u, "u"), (self.v, "v")):
                if flat is not None:
                    B.copy_(flat, B.flat_cat([getattr(st, attr) for st in sts], BLOCK))

    def store(self, B, sts):
        """Without views: copy the buffers back into the tensors' u and v."""
        if not self.views:
            for flat, attr in ((self.u, "u"), (self.v, "v")):
                if flat is not None:
                    for st, a in zip(sts, self.offsets):
                        B.copy_(getattr(st, attr), B.slice(flat, a, a + st.numel))


def sampled_thresholds(B, v, offsets, sizes, samples, ranks, generator):
    """Step 2, §5: every segment's sampled threshold, the ks-th largest of its s sampled
    magnitudes (s = samples[j], ks = ranks[j]; s = 0: not sampled), and a lower one, the
    (LOWER · ks)-th largest (at most the s-th), under which :func:`select` also collects
    candidates.

    One generator call draws every segment's uniforms (the values of one
    :meth:`Backend.sample` per tensor, in order), sampled at
    :func:`~dgc_horovod.core.sparsify.sample_positions` of its own segment; one sort of the keys
    segment · 2**32 + magnitude bits (non-negative float32s order as their bits; NaN above +inf,
    as the backends' k-th largest ranks it) orders every segment's samples at once.

    Args: B, v (the bucket's flat float32 v), offsets, sizes (where each segment starts, its
        elements), samples, ranks (lists of ints per segment), generator. Returns (thresholds,
        lower): lists of float32 bit patterns per segment (:data:`NAN_BITS` where not sampled).
    """
    drawn = [s for s in samples if s]
    if not drawn:
        return [NAN_BITS] * len(sizes), [NAN_BITS] * len(sizes)
    u = B.sample_uniform_many(drawn, generator, v)
    picked = B.abs(B.take(v, B.sample_positions_many(u, sizes, samples, offsets[:-1], v)))
    segment = B.repeat(B.int64_tensor([j * _SEG for j in range(len(sizes))], like=v), samples)
    keys = B.sort(segment + B.to_int64(B.float32_bits(picked)))
    at = []
    for a, s, ks in zip(accumulate(samples, initial=0), samples, ranks):
        if s:
            at += [a + s - ks, a + s - min(s, LOWER * ks)]
    found = iter(B.to_list(B.take(keys, B.int64_tensor(at, like=v))))
    thresholds, lower = [NAN_BITS] * len(sizes), [NAN_BITS] * len(sizes)
    for j, s in enumerate(samples):
        if s:
            thresholds[j], lower[j] = next(found) - j * _SEG, next(found) - j * _SEG
    return thresholds, lower


#: :func:`select` collects the candidates above the (LOWER · ks)-th largest sample, so that the
#: exact top-k is among them also when too few reach the sampled threshold (the rule's fallback).
LOWER = 4


def _threshold_el(B, bits, counts, like):
    """The float32 thresholds of the given bit patterns, each repeated counts[j] times."""
    return B.repeat(B.bits_float32(B.int32_tensor(bits, like=like)), counts)


def _segment_counts(B, cond, counts, like):
    """How many entries of each segment (counts[j] entries each, in order) are True in cond."""
    running = B.to_list(B.take(B.cat([B.int64_zeros(1, like=like), B.cumsum(B.to_int64(cond))]),
                               B.int64_tensor(list(accumulate(counts, initial=0)), like=like)))
    return [b - a for a, b in zip(running, running[1:])]


def candidates(B, v, bmax, offsets, thresholds):
    """The positions of v (ascending) with |v| ≥ their segment's threshold (float32 bits, all
    > 0; NaN selects nothing), their magnitudes, and their count per segment. As the C kernels
    do: bmax, the maximum |v| of every block of :data:`BLOCK` elements (+inf for a block with a
    NaN, :meth:`Backend.block_max_abs`), is compared with its segment's threshold, and only the
    blocks that reach it are read again, element by element (:meth:`Backend.block_candidates`)."""
    blocks = [(b - a) // BLOCK for a, b in zip(offsets, offsets[1:])]
    thr = B.bits_float32(B.int32_tensor(thresholds, like=v))
    hit = B.indices_where_ge(bmax, B.repeat(thr, blocks))
    seg = B.searchsorted(B.int64_tensor([a // BLOCK for a in offsets[1:]], like=v),
                         hit + 1)                       # the segment of each block hit
    pos, mag = B.block_candidates(v, hit, B.take(thr, seg), BLOCK)
    n = B.to_list(B.searchsorted(pos, B.int64_tensor(offsets, like=v)))
    return pos, mag, [b - a for a, b in zip(n, n[1:])]


def _kth(B, cmag, counts, segs, k, cut):
    """cut[j] = the bits of the k[j]-th largest of segment j's candidate magnitudes, for the
    segments segs (one sort of the keys segment · 2**32 + magnitude bits)."""
    if not segs:
        return
    keys = B.sort(B.repeat(B.int64_tensor([j * _SEG for j in range(len(counts))], like=cmag),
                           counts) + B.to_int64(B.float32_bits(cmag)))
    ends = list(accumulate(counts))
    at = B.int64_tensor([ends[j] - k[j] for j in segs], like=cmag)
    for j, key in zip(segs, B.to_list(B.take(keys, at))):
        cut[j] = key - j * _SEG


def _choose(B, cand, cmag, counts, cut):
    """The candidates ≥ their segment's cut (bits), and how many per segment."""
    at = B.indices_where_ge(cmag, _threshold_el(B, cut, counts, cmag))
    ends = B.to_list(B.searchsorted(at, B.int64_tensor(list(accumulate(counts, initial=0)),
                                                        like=cmag)))
    return B.take(cand, at), [b - a for a, b in zip(ends, ends[1:])]


def _settle(B, cand, cmag, counts, topk, k, cut, rest):
    """The candidates ≥ cut (bits per segment) and, for the segments topk (at least k
    candidates each), their exact top-k (cut at the k-th largest magnitude); a segment whose
    top-k set is not unique (a tie at the k-th magnitude) goes to rest instead. Returns the
    positions and the count per segment."""
    _kth(B, cmag, counts, topk, k, cut)
    pos, sel = _choose(B, cand, cmag, counts, cut)
    ties = [j for j in topk if sel[j] != k[j]]
    if ties:                                    # the backend's top-k picks among the tied
        for j in ties:
            cut[j] = NAN_BITS
        rest += ties
        pos, sel = _choose(B, cand, cmag, counts, cut)
    return pos, sel


def select(B, v, offsets, sizes, k, samples, thresholds, lower):
    """Step 3, §5: the positions (in the flat buffer, ascending) each segment sends, and their
    count per segment, as :func:`~dgc_horovod.core.sparsify.select_topk` selects them.

    One comparison over the bucket (:func:`candidates`) collects the candidates |v| ≥ the
    sampled threshold of each segment (every non-zero one where it is not sampled). A threshold
    of 0 is raised to the smallest positive float32: zeros are never sent, and the rule below
    selects the same set. Per segment, :func:`settle <dgc_horovod.core.sparsify.settle>` on the
    candidate count says which rule applies: keep them, or the exact top-k among them; where too
    few were found (the exact top-k over v), a second comparison of those segments' blocks with
    their lower threshold (:func:`sampled_thresholds`) collects more, among which the exact top-k
    is the set of entries ≥ the k-th largest, when at least k were collected, the set is unique
    and the segment has no NaN. The segments where it is not (a tie at the k-th magnitude, too
    few candidates, NaN) run the per-tensor rule on their own. k (list): the target count per
    segment; a segment with k[j] == 0 (non-finite gradient) sends nothing.

    Returns (positions, counts).
    """
    T = len(sizes)
    live = [j for j in range(T) if k[j]]
    first = [NAN_BITS] * T
    for j in live:
        first[j] = max(thresholds[j], 1) if samples[j] else 1
    bmax = B.block_max_abs(v, BLOCK)
    nans = [0] * T                                      # blocks holding a NaN, per segment
    if not B.all_finite(bmax):                          # (one reduction: NaN is rare)
        finite = bmax == bmax
        nans = _segment_counts(B, ~finite,
                               [(b - a) // BLOCK for a, b in zip(offsets, offsets[1:])], v)
        bmax = B.where(finite, bmax, float("inf"))
    cand, cmag, counts = candidates(B, v, bmax, offsets, first)
    topk, keep, again = [], [], []
    for j in live:
        rule = settle(counts[j], k[j]) if samples[j] else (TOPK if counts[j] >= k[j] else KEEP)
        (topk if rule == TOPK else keep if rule == KEEP else again).append(j)
    # a NaN makes the exact top-k over v the backend's: not sampled, or too few candidates
    nan = set(j for j in live if nans[j] and (not samples[j] or j in again))
    rest = sorted(nan)
    topk = [j for j in topk if j not in nan]
    keep = [j for j in keep if j not in nan]
    again = [j for j in again if j not in nan]
    cut = [first[j] if j in keep else NAN_BITS for j in range(T)]
    pos, sel = _settle(B, cand, cmag, counts, topk, k, cut, rest)
    parts = [pos]
    if again:                                   # the lower threshold, for those segments
        second = [NAN_BITS] * T
        for j in again:
            second[j] = max(lower[j], 1)
        cand, cmag, counts = candidates(B, v, bmax, offsets, second)
        rest += [j for j in again if counts[j] < k[j]]
        found = [j for j in again if counts[j] >= k[j]]
        pos, more = _settle(B, cand, cmag, counts, found, k, [NAN_BITS] * T, rest)
        parts.append(pos)
        for j in found:
            sel[j] = more[j]
    for j in sorted(rest):
        mag = B.abs(B.slice(v, offsets[j], offsets[j] + sizes[j]))
        if samples[j]:
            idx = select_above(B, mag, k[j], _f32(thresholds[j]))
        else:
            idx = B.topk_indices(mag, k[j])
            idx = B.drop_zeros(idx, B.take(mag, idx))
        sel[j] = B.numel(idx)
        parts.append(B.sort(idx) + offsets[j])
    return (parts[0] if len(parts) == 1 else B.sort(B.cat(parts))), sel


def compress(B, config, generator, density, fs, g, scale, finite):
    """Steps 1–5 for a bucket's sparsified tensors on tensor ops.

    Args:
        B, config (DGCConfig), generator, density (float, in force).
        fs (FlatState): the tensors' state (loaded: :meth:`FlatState.load` ran).
        g: the flat float32 gradient to accumulate (the segments' gradients one after the
            other, clipping and weight decay as compress applies them), or None when the
            caller accumulated each finite segment itself (per-tensor scales, NaN/Inf in some).
        scale (float): the clipping factor still to apply to g.
        finite (list of bool): per segment; a non-finite one is neither accumulated (the caller
            passes g None then) nor selected, but its sample draws are made.
    Returns:
        (payloads, words, counts, local, vals, u_sent): per segment its payload (finite ones;
        None else), the payload's length in int32 words and its count; the positions sent
        (ascending, local to each segment's tensor), their values and their velocities before
        masking (None without masking), segment after segment.
    """
    c = config
    if g is not None:
        momentum_correction(B, fs.u, fs.v, g, c.momentum, c.nesterov, scale)
    sizes = fs.sizes
    ks = [k_for(n, density) if ok else 0 for n, ok in zip(sizes, finite)]
    samples = [sample_count(n, k_for(n, density), c.sample_ratio, c.exact_topk) for n in sizes]
    ranks = [threshold_rank(n, k_for(n, density), s) if s else 0
             for n, s in zip(sizes, samples)]
    thresholds, lower = sampled_thresholds(B, fs.v, fs.offsets, sizes, samples, ranks,
                                           generator)
    pos, counts = select(B, fs.v, fs.offsets, sizes, ks, samples, thresholds, lower)
    masking = c.momentum_masking and fs.u is not None
    vals = B.take(fs.v, pos)
    u_sent = B.take(fs.u, pos) if masking else None
    clear_sent(B, fs.u, fs.v, pos, masking)
    local = pos - B.repeat(B.int64_tensor(fs.offsets[:-1], like=fs.v), counts)
    payloads, words = wire.encode_many(B, sizes, counts, local, vals)
    return ([p if ok else None for p, ok in zip(payloads, finite)], words, counts, local, vals,
            u_sent)
