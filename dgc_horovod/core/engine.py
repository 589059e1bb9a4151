"""The engine contract: the steps of one bucket's compress and of one tensor's decode, specified
once, here, by the reference engine on tensor ops (:class:`OpsEngine`), and implemented by
engines named after what they run on: the C kernels (CPU tensors,
:mod:`dgc_horovod.core.c_engine`), the Triton kernels (CUDA tensors,
:mod:`dgc_horovod.backends.triton_engine`), and these tensor ops where neither applies. Every
engine gives the same payloads, state and counts, bit for bit, for the same inputs
(``tests/test_conformance.py`` holds each to this one).

A bucket is the unit (a tensor alone is a bucket of one). Its sparsified tensors' velocities u
and residuals v live in one flat float32 buffer each (:class:`FlatState`), segment j (tensor j)
at ``offsets[j]``, a multiple of :data:`BLOCK`; the gaps are zero. An engine receives those
buffers, the tensors' gradients, their clipping factors and a :class:`Step` (host integers and
flags, from the config and the density alone), never the core. Per segment, in order
(Lin et al. 2018, Algorithm 1):

1. **check**: a gradient with NaN/Inf is not accumulated; its payload says so
   (``wire.FLAG_NONFINITE``, no entry);
2. **accumulate** (§3.1, eq. 5–6, :func:`~dgc_horovod.core.accumulate.momentum_correction`):
   u ← m·u + s·g, v ← v + u (Nesterov: v ← v + s·g + m·u), every product and sum rounded to
   float32 on its own (no fused multiply-add), s the clipping factor (§3.2);
3. **select** (§5, :func:`~dgc_horovod.core.sparsify.select`): the rule of
   :mod:`~dgc_horovod.core.sparsify`, sampled at :func:`~dgc_horovod.core.sparsify.sample_base`
   (seed, tensor, step);
4. **mask** (§3.2, :func:`~dgc_horovod.core.accumulate.clear_sent`): the values sent leave v;
   with momentum factor masking their velocities leave u too;
5. **round** (``wire_values="float16"``, :func:`~dgc_horovod.core.precision.round_to_fp16`):
   the rounding error stays in v; a value beyond float16's range zeroes the tensor's u and v;
6. **encode** (:func:`~dgc_horovod.core.wire.encode`): a payload of
   :func:`~dgc_horovod.core.wire.payload_words` (n, k) words.

Decode (:meth:`OpsEngine.decode`): every rank's payload of a tensor checked and added in rank
order (out[i] + value, rank 0 first), then multiplied by float32(1/N) under Average.
"""
from itertools import accumulate

from dgc_horovod.core import precision, sparsify, wire
from dgc_horovod.core.accumulate import clear_sent, momentum_correction

__all__ = ["BLOCK", "flat_offsets", "FlatState", "Step", "Result", "OpsEngine", "make_step"]

#: Each segment of a bucket's flat buffers starts at a multiple of BLOCK elements (the gaps hold
#: zeros), so that the buffers cut into blocks of BLOCK elements of one tensor each.
BLOCK = 64


def flat_offsets(sizes):
    """Where each of the tensors of ``sizes`` starts in a bucket's flat buffers (multiples of
    :data:`BLOCK`), and their length (the last entry)."""
    return list(accumulate((-(-n // BLOCK) * BLOCK for n in sizes), initial=0))


class FlatState:
    """The u and v of a bucket's sparsified tensors as one flat float32 buffer each.

    Attributes: names (tuple), sizes (list of numel), offsets (list: where each segment starts,
    a multiple of :data:`BLOCK`; the last entry is the buffers' length), u (flat buffer, None
    with momentum 0), v. Each tensor's st.u / st.v become views of a segment of them, so the
    backend must have views (NumPy, torch; the engines that need a FlatState, ``flat = True``,
    run only there). The gaps between segments stay zero.
    """

    __slots__ = ("names", "sizes", "offsets", "u", "v", "_us", "_vs")

    def __init__(self, B, sts):
        self.names = tuple(st.name for st in sts)
        self.sizes = [st.numel for st in sts]
        self.offsets = flat_offsets(self.sizes)
        self.u = None if sts[0].u is None else B.flat_cat([st.u for st in sts], BLOCK)
        self.v = B.flat_cat([st.v for st in sts], BLOCK)
        vs = B.flat_views(self.v, self.offsets, self.sizes)
        if vs is None:
            raise TypeError(f"FlatState: the {B.name} backend has no views of flat buffers")
        us = ([None] * len(sts) if self.u is None
              else B.flat_views(self.u, self.offsets, self.sizes))
        for st, u, v in zip(sts, us, vs):    # the tensors' state becomes the buffers' segments
            st.u, st.v = u, v
        self._us, self._vs = us, vs

    def holds(self, sts):
        """True while sts (the same tensors, in order) still have their state in the buffers
        (nothing replaced it: a checkpoint load, another bucket)."""
        if len(sts) != len(self.names):
            return False
        return all(st.u is u and st.v is v for st, u, v in zip(sts, self._us, self._vs))

    def segments(self):
        """(us, vs): each tensor's u (None with momentum 0) and v, views of the buffers."""
        return list(self._us), list(self._vs)


class Step:
    """What an engine needs of one bucket's step besides the tensors: host integers and flags.

    Attributes (lists have one entry per segment): names, sizes, offsets (as
    :class:`FlatState`), plans (:class:`~dgc_horovod.core.sparsify.Plan`), seeds (each
    tensor's step-independent mix32(seed_key ^ tensor_key)), count (the optimizer step that
    :attr:`bases`, the samples' :func:`~dgc_horovod.core.sparsify.sample_base`, follow),
    words (each payload's size, :func:`~dgc_horovod.core.wire.payload_words` (n, k)), pstarts (where each payload starts in
    the result's payload buffer; T + 1 entries), starts (where each segment's selected entries
    start in the result's entry buffers, room for k each; T + 1 entries); momentum (float),
    nesterov, masking (momentum factor masking and momentum > 0), index, values (the wire
    encodings).
    """

    __slots__ = ("names", "sizes", "offsets", "plans", "seeds", "count", "words", "pstarts",
                 "starts", "momentum", "nesterov", "masking", "index", "values")

    def __init__(self, **kw):
        for k, v in kw.items():
            setattr(self, k, v)

    @property
    def bases(self):
        """Each segment's :func:`~dgc_horovod.core.sparsify.sample_base` at step ``count``."""
        return [sparsify.step_base(s, self.count) for s in self.seeds]

    def at(self, count):
        """The same bucket at optimizer step ``count`` (its samples' bases follow it)."""
        out = Step(**{k: getattr(self, k) for k in self.__slots__})
        out.count = count
        return out


def make_step(config, names, sizes, density, step, keys=None):
    """The :class:`Step` of a bucket (its tensors' names and sizes) at ``density`` and optimizer
    step ``step`` (the samples' counter), under ``config``. ``keys``: the tensors'
    :func:`~dgc_horovod.core.sparsify.tensor_key` (computed if None)."""
    c = config
    keys = [sparsify.tensor_key(n) for n in names] if keys is None else keys
    seed = sparsify.seed_key(c.seed)
    plans = [sparsify.plan(n, density, c) for n in sizes]
    words = [wire.payload_words(n, p.k, c.wire_index, c.wire_values)
             for n, p in zip(sizes, plans)]
    return Step(names=tuple(names), sizes=list(sizes), offsets=flat_offsets(sizes), plans=plans,
                seeds=[sparsify.mix32(seed ^ key) for key in keys], count=step, words=words,
                pstarts=list(accumulate(words, initial=0)),
                starts=list(accumulate((p.k for p in plans), initial=0)),
                momentum=float(c.momentum), nesterov=bool(c.nesterov),
                masking=bool(c.momentum_masking and c.momentum > 0), index=c.wire_index,
                values=c.wire_values)


class Result:
    """What an engine's compress returns for a bucket.

    Attributes: payloads (list of flat int32 tensors, segment j's of ``step.words[j]`` words);
    counts (list of int: entries sent per segment; 0 for a non-finite one); finite (list of
    bool); sel, vals, usent (the entries sent, segment j's at ``step.starts[j]`` onwards:
    positions local to the tensor, ascending; the values taken from v, before float16 rounding;
    their velocities before masking, None without masking) — what decompress puts back after a
    non-finite step; fp16 (list of (overflowed, flushed) per segment: entries beyond float16's
    range, non-zero entries rounded to 0); dropped (list of bool: a float16 overflow zeroed the
    segment's u and v, nothing to put back).
    """

    __slots__ = ("payloads", "counts", "finite", "sel", "vals", "usent", "fp16", "dropped")

    def __init__(self, **kw):
        for k, v in kw.items():
            setattr(self, k, v)

    def entries(self, B, step, j, count=None):
        """(positions, values, velocities or None) segment j sent (views); ``count``: its count
        as a Python int (read from ``counts`` if None)."""
        a = step.starts[j]
        b = a + (self.counts[j] if count is None else count)
        return (B.slice(self.sel, a, b), B.slice(self.vals, a, b),
                None if self.usent is None else B.slice(self.usent, a, b))


class OpsEngine:
    """The reference engine: the contract's steps on the backend's tensor ops, one segment after
    the other (host reads for the thresholds, counts and sizes). Runs the NumPy reference
    (:class:`~dgc_horovod.core.backend.NumpyBackend`), and tensors neither the C nor the Triton
    engine takes (e.g. TensorFlow's eager tensors on a GPU). It works on each tensor's own u and
    v, so it needs no :class:`FlatState` (``flat = False``)."""

    name = "ops"
    flat = False

    def __init__(self, B):
        self.B = B

    def compress(self, step, us, vs, grads, scales, flat=None):
        """Steps 1–6 for every segment (module docstring).

        Args: step (:class:`Step`); us, vs: each segment's flat float32 u (None with momentum
            0) and v, updated in place (views of the bucket's :class:`FlatState` buffers, or the
            tensors' own); grads: flat float32 gradient per segment (read only); scales: the
            clipping factor per segment (float); flat: the (u, v) buffers of the bucket's
            FlatState, for the engines that work on them (``flat = True``; unused here).
        Returns a :class:`Result`."""
        B = self.B
        like = vs[0]
        bases = step.bases
        sels, vals, usent = [], [], []
        payloads, counts, finite, fp16, dropped = [], [], [], [], []
        for j, (uj, vj, g) in enumerate(zip(us, vs, grads)):
            n, p = step.sizes[j], step.plans[j]
            ok = B.all_finite(g)
            finite.append(ok)
            c, f16, drop = 0, (0, 0), False
            idx = B.empty_indices(like=like)
            x = sent = us_j = B.zeros(0, like=like)
            if ok:
                momentum_correction(B, uj, vj, g, step.momentum, step.nesterov, scales[j])  # 2.
                idx = sparsify.select(B, vj, p, bases[j])                               # 3.
                c = B.numel(idx)
                x = B.take(vj, idx)
                us_j = B.take(uj, idx) if step.masking else None
                clear_sent(B, uj, vj, idx, step.masking)                                # 4.
                sent = x
                if step.values == "float16":                                            # 5.
                    sent, f16, drop = precision.round_to_fp16(B, uj, vj, idx, x)
            payloads.append(wire.encode(B, n, idx, sent,                                   # 6.
                                        0 if ok else wire.FLAG_NONFINITE, step.index,
                                        step.values, p.k))
            pad = p.k - c
            sels += [idx, B.int64_zeros(pad, like=like)]
            vals += [x, B.zeros(pad, like=like)]
            if step.masking:
                usent += [us_j, B.zeros(pad, like=like)]
            counts.append(c)
            fp16.append(f16)
            dropped.append(drop)
        return Result(payloads=payloads, counts=counts, finite=finite, sel=B.cat(sels),
                      vals=B.cat(vals), usent=B.cat(usent) if step.masking else None,
                      fp16=fp16, dropped=dropped)

    def decode(self, gathered, numel, ranks, out, inv=None, name="<tensor>"):
        """The sum of the ``ranks`` payloads of one tensor in ``gathered`` (int32 words, rank
        order) into the flat float32 ``out`` of ``numel`` elements (zeroed first), in rank
        order (out[i] + value, rank 0 first), then times float32(inv) where inv is not None.
        Returns True when the step is non-finite (a rank flagged NaN/Inf, or sent a value beyond
        float16's range); ``out`` is then to be discarded. Raises
        :class:`~dgc_horovod.core.wire.WireFormatError` for a malformed payload (naming
        ``name`` and the rank)."""
        B = self.B
        positions = []
        _, nonfinite = wire.decode_sum(B, gathered, numel, ranks, name, positions, out)
        if not nonfinite and inv is not None and positions:
            # only where a rank sent something (elsewhere 0 · inv is 0 anyway): the same bits
            # as the whole tensor; a position sent by several ranks is scaled once
            B.scale_at_(out, positions[0] if len(positions) == 1 else B.cat(positions), inv)
        return nonfinite
