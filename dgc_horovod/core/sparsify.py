"""Top-k selection by magnitude (Lin et al. 2018, Algorithm 1 and §5): the rule every engine
follows, its constants, and its reference on tensor ops.

Algorithm 1 sends, per tensor and step, the entries of the accumulated velocity v whose
magnitude reaches the top-R% threshold: the k = ceil(R·n) largest |v| (:func:`k_for`). §5 finds
that threshold cheaply: sample a fraction of |v|, take the threshold among the samples, compare
once, and refine among the few that pass. Our rule makes every choice that approach leaves open
explicit, so that the NumPy reference, the C kernels, the Triton kernels and the TensorFlow
graph select the same entries, bit for bit, and none of them hands a case to another:

1. **Plan** (:class:`Plan`, host integers from (n, density) alone): k; s sampled positions
   (:func:`sample_count`; 0 when 2k >= n or ``exact_topk``: no sampling); the ranks ks1 and
   ks2 (:func:`threshold_rank`, and LOWER times it, at most s: :func:`plan_k`) of an upper
   and a lower threshold among the samples.
2. **Sample** (§5): positions ``(h_i · n) >> 32`` with h_i = mix32(base + i·GOLDEN) for
   i < s, where base = :func:`sample_base` (seed, tensor, step): a counter-based hash that every
   engine computes itself (no generator state, no draws uploaded). The magnitudes are compared
   as their float32 bit patterns with the sign cleared (:func:`magnitude_bits`: non-negative
   floats order as their bits; NaN above +inf), so each threshold is an exact sample value.
3. **Threshold**: t1 = the ks1-th largest sampled magnitude, t2 = the ks2-th largest, each at
   least 1 (the smallest positive float32: zeros are never sent); without sampling t1 = t2 = 1.
4. **Candidates**: if at least k entries of the tensor reach t1, the level is t1, else t2; the
   candidates are the positions whose magnitude reaches the level.
5. **Settle to k**: the k candidates of largest magnitude, ties at the k-th magnitude to the
   lower position (all candidates when there are fewer than k), in ascending position order.

So what is sent is always the top of |v|: exactly Algorithm 1's top-k (ties to the lower
position) whenever at least k entries reach the lower threshold (nearly always: the upper one
aims at 1.25·k of them, the lower one at 4 times as many), else every entry that reaches it.
The samples only decide how much an engine reads to find it. The sizes an engine needs (k, s,
the payload's words; at most n candidates) follow from n and the density: a device engine needs
nothing back from the device.
"""
import math
import zlib

__all__ = ["is_sparse", "k_for", "sample_count", "threshold_rank",
           "Plan", "plan", "plan_k", "mix32", "seed_key", "tensor_key", "sample_base", "step_base", "sample_positions",
           "magnitude_bits", "select", "MIN_SAMPLES", "SAMPLE_OVERSHOOT", "LOWER", "MIX_M1",
           "MIX_M2", "GOLDEN", "MIN_BITS"]

#: Fewest entries sampled for the threshold estimate (below that the estimate is noise).
MIN_SAMPLES = 64
#: The upper threshold aims at this many times k candidates (so that usually k reach it).
SAMPLE_OVERSHOOT = 1.25
#: The lower threshold's rank is LOWER times the upper one's (used when fewer than k reach t1).
LOWER = 4
#: The multipliers of :func:`mix32` (the "lowbias32" integer hash) and the step between the
#: counters of consecutive samples (2**32 / golden ratio).
MIX_M1, MIX_M2, GOLDEN = 0x7FEB352D, 0x846CA68B, 0x9E3779B9
#: The smallest magnitude that is ever sent, as float32 bits (the smallest positive float32).
MIN_BITS = 1
_M32 = 0xFFFFFFFF


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
    """s, the positions the threshold estimate samples in a tensor of n elements with target
    count k: max(MIN_SAMPLES, ceil(sample_ratio · n)), at most n; 0 (no sampling: every non-zero
    entry is a candidate) in exact mode or when k >= n/2."""
    if exact or k * 2 >= n:
        return 0
    return min(n, max(MIN_SAMPLES, math.ceil(sample_ratio * n)))


def threshold_rank(n, k, s):
    """ks1, the rank of the upper threshold among the s sampled magnitudes (§5):
    ceil(SAMPLE_OVERSHOOT · k · s / n), in [1, s]: about 1.25·k entries reach it."""
    return min(s, max(1, math.ceil(SAMPLE_OVERSHOOT * k * s / n)))


class Plan:
    """The selection's sizes for one tensor at one density (host integers): n, k, s, ks1, ks2
    (see the module docstring)."""

    __slots__ = ("n", "k", "s", "ks1", "ks2")

    def __init__(self, n, k, s, ks1, ks2):
        self.n, self.k, self.s, self.ks1, self.ks2 = n, k, s, ks1, ks2

    cap = property(lambda self: self.n, doc="Room an engine keeps for the candidates: n (every "
                                            "candidate is kept).")

    def __eq__(self, other):
        return isinstance(other, Plan) and all(getattr(self, a) == getattr(other, a)
                                               for a in self.__slots__)

    def __repr__(self):
        return "Plan(" + ", ".join(f"{a}={getattr(self, a)}" for a in self.__slots__) + ")"


def plan(n, density, config):
    """The :class:`Plan` of a tensor of n elements at ``density`` under ``config``
    (``sample_ratio``, ``exact_topk``)."""
    return plan_k(n, k_for(n, density), config.sample_ratio, config.exact_topk)


def plan_k(n, k, sample_ratio, exact=False):
    """The :class:`Plan` of a tensor of n elements for a target count k (1 <= k <= n)."""
    s = sample_count(n, k, sample_ratio, exact)
    ks1 = threshold_rank(n, k, s) if s else 0
    return Plan(n, k, s, ks1, min(s, LOWER * ks1))


# ----------------------------------------------------------------------------- sampling
# The integer steps below use +, *, //, & and ^ on non-negative values only (x // 2**s is
# x >> s, x * 2**s is x << s): operators that Python ints and the int64 tensors of NumPy, PyTorch
# and TensorFlow all have, with the same results.
def _mul32(x, c):
    """(x · c) mod 2**32 for x < 2**32 and a constant c < 2**32, without any intermediate at or
    above 2**63."""
    return ((x & 0xFFFF) * c + (((x // 65536) * c) & 0xFFFF) * 65536) & _M32


def mix32(x):
    """The lowbias32 integer hash of x in [0, 2**32) (Python int or int64 tensor):
    x ^= x >> 16; x *= MIX_M1; x ^= x >> 15; x *= MIX_M2; x ^= x >> 16 (mod 2**32)."""
    x = x ^ (x // 65536)
    x = _mul32(x, MIX_M1)
    x = x ^ (x // 32768)
    x = _mul32(x, MIX_M2)
    return x ^ (x // 65536)


def seed_key(seed):
    """The 32-bit key of ``config.seed`` (an int in [0, 2**63))."""
    return mix32((seed & _M32) ^ mix32(seed >> 32))


def tensor_key(name):
    """The 32-bit key of a tensor: CRC-32 of its name (the same on every rank)."""
    return zlib.crc32(name.encode("utf-8"))


def sample_base(seed_k, tensor_k, step):
    """The counter base of a tensor's samples at ``step`` (int >= 0, the optimizer step):
    mix32((mix32(seed_key ^ tensor_key) + step · GOLDEN) mod 2**32). Works on Python ints and
    on int64 scalar tensors (a graph's step counter)."""
    return step_base(mix32(seed_k ^ tensor_k), step)


def step_base(tensor_seed, step):
    """:func:`sample_base` from the step-independent part mix32(seed_key ^ tensor_key)."""
    return mix32((tensor_seed + _mul32(step & _M32, GOLDEN)) & _M32)


def sample_positions(B, base, s, n, like):
    """The s sampled positions of a tensor of n elements: (mix32((base + i·GOLDEN) mod 2**32)
    · n) >> 32 for i = 0..s-1 (uniform over [0, n) with replacement). int64 tensor of s."""
    i = B.arange(s, like=like)
    h = mix32((_mul32(i, GOLDEN) + base) & _M32)
    return (h * n) // 2 ** 32


def magnitude_bits(B, v):
    """|v| as int64 float32 bit patterns (sign cleared): they order as the magnitudes, NaN above
    +inf."""
    return B.to_int64(B.float32_bits(v)) & 0x7FFFFFFF


# ----------------------------------------------------------------------------- the rule
def select(B, v, p, base):
    """The positions of v (flat float32, p.n elements) that the rule of the module docstring
    sends under :class:`Plan` p, ascending (int64 tensor of at most p.k entries). ``base``: the
    tensor's :func:`sample_base` at this step. v is read only.

    Tensor ops with a few host reads (the thresholds and counts); the C and Triton engines
    compute the same without them."""
    bits = magnitude_bits(B, v)
    t1 = t2 = MIN_BITS
    if p.s:
        # the ks1-th and ks2-th largest sampled magnitudes, from one sort
        srt = B.sort(B.take(bits, sample_positions(B, base, p.s, p.n, like=bits)))
        t1, = B.to_list(B.slice(srt, p.s - p.ks1, p.s - p.ks1 + 1))
        t2, = B.to_list(B.slice(srt, p.s - p.ks2, p.s - p.ks2 + 1))
        t1, t2 = max(t1, MIN_BITS), max(t2, MIN_BITS)
    level = t1 if B.count_true(bits >= t1) >= p.k else t2
    cand = B.indices_where_ge(bits, level)                # ascending
    if B.numel(cand) <= p.k:
        return cand
    # the k largest by (magnitude, then the lower position): one top-k of the int64 keys
    # magnitude · 2**32 + (2**32 - 1 - position)
    keys = B.take(bits, cand) * 2 ** 32 + (_M32 - cand)
    return B.sort(B.take(cand, B.topk_indices(keys, p.k)))
