"""DGC's per-step work as TensorFlow graph ops, traced into the step's ``tf.function``: no
``tf.py_function``, no Python per step (the TensorFlow adapter's default, ``DGC(in_graph=True)``).

The state is the core's (:class:`GraphCore` is a :class:`~dgc_horovod.core.DGCCore` whose
tensors are ``tf.Variable``\\ s of the TensorFlow backend); the steps are those of the eager
core, written as graph ops, in the order they run (Lin et al. 2018, Algorithm 1):

1. **step** (:meth:`GraphCore.step_ops`, once per traced reduction, in the graph that holds the
   gradients): the step counter, a ``tf.Variable``, advances; the warm-up density (§3.3) is the
   core's own :func:`~dgc_horovod.core.warmup.density_at_step` table at that step (or, with
   ``warmup_epochs``, a variable :meth:`GraphCore.set_epoch` sets); the world size N; the local
   clipping factor over all of the rank's gradients (§3.2, ``clip_scope="global"``); and every
   sparsified tensor's threshold samples (§5), drawn from the core's generator in the order
   Horovod hands the gradients over, as the eager core draws them;
2. **clip and accumulate** (§3.1-3.2, :meth:`GraphCore.compress_ops`): s·g (+ λ·w with
   ``weight_decay_mode="accumulated"``), then momentum correction
   (:func:`~dgc_horovod.core.accumulate.momentum_correction` on the variables, the same backend
   calls as the eager path); a gradient with NaN/Inf leaves the state untouched;
3. **select** (§5, :func:`select`): the sampled threshold, the candidates and the settle rule of
   :func:`~dgc_horovod.core.sparsify.select_topk` as ``tf.case`` branches;
4. **mask** (§3.2): :func:`~dgc_horovod.core.accumulate.clear_sent`; float16 wire values round
   as :func:`~dgc_horovod.core.precision.round_to_fp16` rounds them;
5. **encode** (:func:`encode`): the payload of :mod:`dgc_horovod.core.wire`, word for word;
   in buckets (``bucket_numel``, :meth:`GraphCore.plan_ops`, the default) the payloads of a
   bucket's members framed into one segment (:func:`frame_bucket`, the words of
   :func:`~dgc_horovod.core.wire.frame_bucket`) for one ``hvd.allgather`` per bucket;
6. after Horovod's allgather, **decode and average** (:func:`decode_sum`, :func:`decode_bucket`,
   :meth:`GraphCore.decompress_ops`): every rank's payload summed in rank order (a
   ``tf.while_loop`` over the ranks), times 1/N under ``op=hvd.Average``; after a non-finite
   step NaN everywhere and this rank's sent entries put back; then the separate weight decay
   (``weight_decay_mode="separate"``).

How Horovod's conventions map onto the paper's: as in the eager core
(:mod:`dgc_horovod.core.compressor`): each rank accumulates its mean gradient g_k = N·∇k and
the decoded sum is divided by N, which by linearity is Algorithm 1's update; the local clipping
threshold is C·√N under Average (C/√N under Sum).

On a CPU, the same results as the eager core on the TensorFlow backend, bit for bit: payloads,
state, updates, generator state (``tests/test_tf_graph.py`` runs both side by side for every
option; among equal magnitudes both send the lower positions). On a GPU not measured: no GPU
machine here has Horovod, and TensorFlow's GPU kernels may round u·m + g once (a fused
multiply-add) where the CPU rounds twice.

A step is one run of a traced reduction in which Horovod reduces (its ``_allreduce_cond``
holds: this rank in the process set, more than one rank): the step counter, the warm-up and the
threshold draws advance then, as they do when the eager core's compress runs. A training step
that runs two reductions (two ``tape.gradient`` calls) counts two steps; the eager core counts a
step when a tensor comes again, i.e. one step where the two reduce different variables (a GAN's
two models): there the warm-up advances twice as fast in the graph (``warmup_epochs`` with
``set_epoch`` does not depend on it).
What the graph does not do per step: ``compress_seconds`` is 0 (no clock in the graph); the statistics
are counted in ``tf.Variable``\\ s, one row per tensor, and read when ``dgc.stats`` is;
float16 overflow / flush warnings are given when the statistics (or a checkpoint) are read; the
warning that an epoch-driven warm-up never got ``set_epoch()`` is printed to stderr by the step.
"""
import os
import sys

import horovod.tensorflow as hvd
import tensorflow as tf

from dgc_horovod.backends.tf_backend import variable
from dgc_horovod.core import DGCCore, wire
from dgc_horovod.core import checkpoint, compressor
from dgc_horovod.core.checkpoint import FitCheck
from dgc_horovod.core.accumulate import clear_sent, momentum_correction
from dgc_horovod.core.buckets import plan_buckets
from dgc_horovod.core.sparsify import MIN_SAMPLES, SAMPLE_OVERSHOOT, is_sparse
from dgc_horovod.core.stats import CompressionStats
from dgc_horovod.core.warmup import density_at_step
from dgc_horovod.tensorflow.variables import collective_name

__all__ = ["GraphCore", "GraphPath", "select", "top_k_ascending", "encode", "decode_sum",
           "frame_bucket", "decode_bucket", "global_clip_factor"]

_ESCAPE = 65535
#: DGC's graph functions are traced as written: AutoGraph must not rewrite their Python control
#: flow, which depends only on settings and static shapes
_plain = tf.autograph.experimental.do_not_convert
#: The statistics one tensor adds per step, in the order of its row (int64 tf.Variable).
FIELDS = ("tensors", "sparse_tensors", "elements", "selected", "wire_bytes", "received_bytes",
          "dense_bytes", "nonfinite_tensors", "overflowed_entries", "flushed_entries")
_RECEIVED = FIELDS.index("received_bytes")
_WIRE = FIELDS.index("wire_bytes")


# --------------------------------------------------------------------------- the steps as ops
@_plain
def k_for(numel, density):
    """:func:`~dgc_horovod.core.sparsify.k_for` in float64 graph ops (the same rounding);
    ``density``: float64 scalar tensor. int64 scalar."""
    k = tf.math.ceil(density * float(numel) - 1e-9)
    return tf.cast(tf.clip_by_value(k, 1.0, float(numel)), tf.int64)


def sample_count(numel, config):
    """s of :func:`~dgc_horovod.core.sparsify.sample_count` when the tensor samples (2k < n)."""
    return 0 if config.exact_topk else min(numel, max(MIN_SAMPLES,
                                                      -int(-config.sample_ratio * numel // 1)))


def _topk(x, k):
    """The TensorFlow backend's topk_indices (the same op, the same ties)."""
    return tf.cast(tf.math.top_k(x, tf.cast(k, tf.int32), sorted=False).indices, tf.int64)


#: bins of :func:`top_k_ascending`'s histogram: the top 15 bits of a non-negative float32
_BINS = 1 << 15
#: up to this many elements :func:`top_k_ascending` sorts ``tf.math.top_k``'s positions (the
#: histogram's fixed cost, its 32768 bins, is more than top-k's there)
_SMALL = 1 << 16


@_plain
def top_k_ascending(mag, k):
    """The positions of the k largest of ``mag`` (non-negative float32, k <= its size), in
    ascending order; among equal values the lower positions, as ``tf.math.top_k`` chooses them
    on a CPU. Up to 65536 elements: top-k's positions sorted. Beyond, O(n): non-negative floats
    order as their int32 bit patterns, so one histogram of the top 15 bits finds the bin that
    holds the k-th largest, a top-k of that bin alone its value t, and the result is every
    element above t and the first of those equal to t."""
    def small():
        return tf.cast(tf.sort(tf.cast(_topk(mag, k), tf.int32)), tf.int64)

    n = mag.shape[0]
    if n is not None:       # a static size (a whole tensor) picks one at trace time
        return small() if n <= _SMALL else _histogram_top_k(mag, k)
    return tf.cond(tf.size(mag) <= _SMALL, small, lambda: _histogram_top_k(mag, k))


def _histogram_top_k(mag, k):
    """:func:`top_k_ascending` beyond ``_SMALL`` elements (its docstring)."""
    bits = tf.bitcast(mag, tf.int32)
    hi = tf.bitwise.right_shift(bits, 16)
    counts = tf.cast(tf.math.bincount(hi, minlength=_BINS, maxlength=_BINS, dtype=tf.int32),
                     tf.int64)      # int32: the dtype every device has a kernel for
    k = tf.cast(k, tf.int64)
    upto = tf.cumsum(counts, reverse=True)              # elements in this bin or above
    b = tf.math.count_nonzero(upto >= k, dtype=tf.int32) - 1
    rank = tf.cast(k - (upto[b] - counts[b]), tf.int32)     # t's rank inside bin b
    t = tf.math.top_k(tf.gather(bits, tf.reshape(tf.where(tf.equal(hi, b)), [-1])),
                      rank, sorted=True).values[rank - 1]
    above = bits > t
    tie = tf.equal(bits, t)
    need = k - tf.math.count_nonzero(above, dtype=tf.int64)
    keep = tf.logical_or(above, tf.logical_and(
        tie, tf.cumsum(tf.cast(tie, tf.int64)) <= need))
    return tf.reshape(tf.where(keep), [-1])


@_plain
def select(mag, k, draws, ascending=True):
    """:func:`~dgc_horovod.core.sparsify.select_topk` as graph ops: the positions to send (int64,
    unique, zeros dropped) among the magnitudes ``mag`` (float32, n elements) for the target
    count ``k`` (int64 scalar tensor). ``draws``: None (exact top-k), or the s float64 uniforms
    of the tensor's threshold samples, used when 2k < n (as sample_count rules).
    ``ascending``: the positions in ascending order, each top-k by :func:`top_k_ascending`
    (the same sets as ``tf.math.top_k``, without its sort); False: ``tf.math.top_k``'s order,
    as the eager core sends int32 indices."""
    n = mag.shape[0]

    def topk_of(positions):
        if not ascending:
            return _topk(mag if positions is None else tf.gather(mag, positions), k)
        return top_k_ascending(mag if positions is None else tf.gather(mag, positions), k)

    def exact():
        return topk_of(None)

    def by_sample():
        s = int(draws.shape[0])
        samples = tf.gather(mag, tf.minimum(tf.cast(draws * float(n), tf.int64), n - 1))
        # threshold_rank: min(s, max(1, ceil(1.25 · k · s / n))), the same float64 operations
        rank = tf.cast(tf.clip_by_value(tf.math.ceil(
            SAMPLE_OVERSHOOT * tf.cast(k, tf.float64) * float(s) / float(n)), 1.0, float(s)),
            tf.int32)
        threshold = tf.math.top_k(samples, rank, sorted=True).values[rank - 1]
        cand = tf.reshape(tf.where(mag >= threshold), [-1])
        count = tf.size(cand, out_type=tf.int64)
        # the settle rule (sparsify.settle): > k the exact top-k among the candidates; < k/2 an
        # exact top-k over all; else the candidates
        return tf.case([(count > k, lambda: tf.gather(cand, topk_of(cand))),
                        (2 * count < k, exact)], default=lambda: cand)

    idx = exact() if draws is None else tf.cond(2 * k < n, by_sample, exact)
    return tf.boolean_mask(idx, tf.gather(mag, idx) > 0)


def _pack16(tokens):
    """Values in 0..65535 (or float16 bit patterns) as int32 words, two a word, low half first,
    a zero appended to an odd count: the TensorFlow backend's pack16."""
    t = tf.pad(tokens, [[0, tf.size(tokens) % 2]])
    return tf.bitcast(tf.reshape(t, [-1, 2]), tf.int32)


@_plain
def encode(numel, idx, values, flags=0, index="delta16", value_dtype="float32"):
    """:func:`dgc_horovod.core.wire.encode` as graph ops, the same words: ``idx`` int64
    positions (ascending for delta16), ``values`` float32 in their order, ``flags`` an int or
    an int32 scalar tensor; the int32 payload."""
    c = tf.size(idx)
    if index == "int32":
        tokens, idx_words = c, tf.cast(idx, tf.int32)
    else:
        prev = tf.concat([tf.constant([-1], tf.int64), idx], 0)[:-1]
        gaps = idx - prev                                   # >= 1
        escapes = (gaps - 1) // _ESCAPE
        ends = tf.cumsum(escapes + 1)                       # tokens up to each entry
        n_tokens = tf.reduce_sum(escapes + 1)
        # no gap beyond 65535 (the common case): the tokens are the gaps
        toks = tf.cond(tf.equal(n_tokens, tf.size(idx, out_type=tf.int64)), lambda: gaps,
                       lambda: tf.scatter_nd(tf.reshape(ends - 1, [-1, 1]),
                                             gaps - escapes * _ESCAPE, tf.reshape(n_tokens, [1])))
        tokens = tf.cast(n_tokens, tf.int32)
        idx_words = _pack16(tf.cast(toks, tf.uint16))
    if value_dtype == "float32":
        val_words = tf.bitcast(values, tf.int32)
    else:
        val_words = _pack16(tf.cast(values, tf.float16))
    word3 = tf.bitwise.bitwise_or(tf.cast(flags, tf.int32),
                                  wire.INDEX_ENCODINGS.index(index) << 8
                                  | wire.VALUE_DTYPES.index(value_dtype) << 16)
    header = tf.stack([tf.constant(wire.MAGIC_V2, tf.int32), tf.constant(numel, tf.int32), c,
                       word3, tokens])
    return tf.concat([header, idx_words, val_words], 0)


def _check(cond, name, what, rank=None, subject="payload of tensor"):
    """An assert naming the tensor or bucket (and the rank that sent the payload), as
    :class:`~dgc_horovod.core.wire.WireFormatError` does in the eager decode."""
    data = [f"DGC {subject} {name!r} {what}"]
    if rank is not None:
        data += ["(from rank", rank, ")"]
    return tf.debugging.Assert(cond, data, name="DGCPayloadCheck")


def _read_payload(gathered, total, pos, numel, name, rank):
    """:func:`~dgc_horovod.core.wire.read_payload` as graph ops, for the payload at word ``pos``:
    (the word after it, int64 positions, float32 values, whether it is non-finite: flagged, or
    a float16 value beyond float16's range). Asserts name the tensor, the rank and the fault."""
    with tf.control_dependencies([_check(pos + wire.HEADER_WORDS <= total, name,
                                         "is truncated: no complete header", rank)]):
        head = tf.identity(gathered[pos:pos + wire.HEADER_WORDS])
    magic, n, c, word3, t = tf.unstack(head, wire.HEADER_WORDS)
    bits = tf.bitwise
    flags = bits.bitwise_and(word3, 0xFF)
    icode = bits.bitwise_and(bits.right_shift(word3, 8), 0xFF)
    vcode = bits.bitwise_and(bits.right_shift(word3, 16), 0xFF)
    int32_idx, fp32 = tf.equal(icode, 0), tf.equal(vcode, 0)
    idx_words = tf.where(int32_idx, c, (t + 1) // 2)
    val_words = tf.where(fp32, c, (c + 1) // 2)
    start = pos + wire.HEADER_WORDS
    end = start + idx_words + val_words
    known = tf.logical_and(tf.logical_and(icode < len(wire.INDEX_ENCODINGS),
                                          vcode < len(wire.VALUE_DTYPES)),
                           tf.equal(bits.right_shift(word3, 24), 0))
    checks = [
        _check(tf.equal(magic, wire.MAGIC_V2), name, "has another header than DGC wire format "
               "v2: are all ranks running the same dgc_horovod version?", rank),
        _check(tf.equal(n, numel), name, f"describes another number of elements than this "
               f"rank's {numel}: the models differ", rank),
        _check(tf.logical_and(0 <= c, c <= numel), name, "claims more entries than the tensor "
               "has elements", rank),
        _check(known, name, "has an unknown encoding word", rank),
        _check(tf.logical_and(tf.logical_or(tf.logical_not(int32_idx), tf.equal(t, c)),
                              tf.logical_and(c <= t, t <= numel)), name,
               "has an index token count that does not fit its entries", rank),
        _check(end <= total, name, "is truncated", rank)]
    with tf.control_dependencies(checks):
        iw = gathered[start:start + idx_words]
        vw = gathered[start + idx_words:end]

    def delta16():
        toks = tf.cast(tf.reshape(tf.bitcast(iw, tf.uint16), [-1])[:t], tf.int64)

        def escaped():
            is_entry = toks != 0
            return tf.boolean_mask(tf.cumsum(tf.where(is_entry, toks, _ESCAPE)) - 1, is_entry)

        # no escape token (the common case): the positions are the gaps' running sum
        plain = tf.logical_and(tf.equal(t, c), tf.reduce_all(toks > 0))
        idx = tf.cond(plain, lambda: tf.cumsum(toks) - 1, escaped)
        with tf.control_dependencies([_check(tf.equal(tf.size(idx), c), name, "has index "
                                             "tokens that do not match its header", rank)]):
            return tf.identity(idx)

    idx = tf.cond(int32_idx, lambda: tf.cast(iw, tf.int64), delta16)
    vals = tf.cond(fp32, lambda: tf.bitcast(vw, tf.float32),
                   lambda: tf.cast(tf.reshape(tf.bitcast(vw, tf.float16), [-1])[:c],
                                   tf.float32))
    with tf.control_dependencies([_check(tf.reduce_all((idx >= 0) & (idx < numel)), name,
                                         "has an index outside the tensor", rank)]):
        idx = tf.identity(idx)
    bad = tf.logical_or(
        tf.not_equal(bits.bitwise_and(flags, wire.FLAG_NONFINITE), 0),
        tf.logical_and(tf.logical_not(fp32),
                       tf.logical_not(tf.reduce_all(tf.math.is_finite(vals)))))
    return end, idx, vals, bad


@_plain
def decode_sum(gathered, numel, world_size, name, rank_loop=None):
    """:func:`dgc_horovod.core.wire.decode_sum` as graph ops: (the dense float32 sum of every
    rank's payload, added in rank order; True when a rank flagged a non-finite gradient or sent
    a float16 value beyond float16's range). ``world_size``: int32 scalar (a tensor: an elastic
    job changes it without retracing). Any of the payload formats, as each describes its own.
    A malformed payload stops the step with an InvalidArgumentError naming the tensor, what is
    wrong and the rank (the checks of :func:`~dgc_horovod.core.wire.read_payload`).

    The sum: on a CPU one ``unsorted_segment_sum`` of every rank's entries in rank order (it
    adds them in that order: the eager core's bits, one pass over the tensor; 8x faster than
    ``scatter_nd`` here); where TensorFlow sees a GPU (``rank_loop`` None) one scatter per rank,
    in rank order, since a GPU adds a position's entries in any order (atomics) and ranks would
    differ in the last bit from 3 ranks on."""
    dense, nonfinite, _ = _decode(gathered, [numel], [name], world_size, None, rank_loop)[0]
    return dense, nonfinite


@_plain
def frame_bucket(payloads):
    """:func:`dgc_horovod.core.wire.frame_bucket` as graph ops, the same words: one rank's
    segment of a bucket's allgather, every member's payload (int32) in member order."""
    parts = [tf.constant([wire.BUCKET_MAGIC, len(payloads)], tf.int32)]
    for j, payload in enumerate(payloads):
        parts += [tf.constant([j], tf.int32), payload]
    return tf.concat(parts, 0)


@_plain
def decode_bucket(gathered, numels, names, world_size, bucket, rank_loop=None):
    """:func:`decode_sum` of every member of a bucket's allgather (every rank's
    :func:`frame_bucket` segment, in rank order): per member (dense sum, non-finite, its words
    over all ranks: payload and member word, plus the bucket header for the first member).
    Every rank of the graph path sends every member, in member order (the eager
    :func:`~dgc_horovod.core.wire.split_bucket` also reads segments that omit some); a segment
    that does not stops the step with an InvalidArgumentError naming the bucket and the rank."""
    return _decode(gathered, numels, names, world_size, bucket, rank_loop)


def _decode(gathered, numels, names, world_size, bucket, rank_loop):
    """:func:`decode_sum` (``bucket`` None: one payload per rank) and :func:`decode_bucket`
    (``bucket``: its name; one framed segment per rank) in one ``tf.while_loop`` over the
    ranks."""
    total = tf.size(gathered)
    if rank_loop is None:
        rank_loop = bool(tf.config.list_logical_devices("GPU"))
    members = len(numels)

    def body(rank, pos, accs, nonfinite, words):
        accs, nonfinite, words = list(accs), list(nonfinite), list(words)
        for j in range(members):
            start = pos
            if bucket is not None:
                pos = _bucket_word(gathered, total, pos, j, members, bucket, rank)
            end, idx, vals, bad = _read_payload(gathered, total, pos, numels[j], names[j], rank)
            if rank_loop:
                accs[j] = tf.tensor_scatter_nd_add(accs[j], tf.reshape(idx, [-1, 1]), vals)
            else:
                accs[j] = (accs[j][0].write(rank, idx), accs[j][1].write(rank, vals))
            nonfinite[j] = tf.logical_or(nonfinite[j], bad)
            words[j] = words[j] + tf.cast(end - start, tf.int64)
            pos = end
        return rank + 1, pos, tuple(accs), tuple(nonfinite), tuple(words)

    accs = tuple(tf.zeros([n], tf.float32) if rank_loop else
                 (tf.TensorArray(tf.int64, 0, dynamic_size=True, infer_shape=False),
                  tf.TensorArray(tf.float32, 0, dynamic_size=True, infer_shape=False))
                 for n in numels)
    _, pos, accs, nonfinite, words = tf.while_loop(
        lambda rank, *_: rank < world_size, body,
        (tf.constant(0, tf.int32), tf.constant(0, tf.int32), accs,
         tuple(tf.constant(False) for _ in numels),
         tuple(tf.constant(0, tf.int64) for _ in numels)))
    if bucket is None:
        last = _check(tf.equal(pos, total), names[0], "is followed by unexpected trailing "
                      "words after the last rank's")
    else:
        last = _check(tf.equal(pos, total), bucket, "has unexpected trailing words after the "
                      "last rank's segment", subject="bucket")
    out = []
    with tf.control_dependencies([last]):
        for n, acc, bad, w in zip(numels, accs, nonfinite, words):
            if not rank_loop:   # a CPU's segment sum adds its entries in their order
                acc = tf.math.unsorted_segment_sum(acc[1].concat(), acc[0].concat(), n)
            out.append((tf.identity(acc), tf.identity(bad), tf.identity(w)))
    return out


def _bucket_word(gathered, total, pos, j, members, bucket, rank):
    """Checks the framing before member ``j``'s payload at word ``pos`` of a rank's bucket
    segment (the segment's header first, for j = 0); the position of that payload."""
    def check(cond, what):
        return _check(cond, bucket, what, rank, subject="bucket")

    if j == 0:
        with tf.control_dependencies([check(pos + 2 <= total, "is truncated: no bucket "
                                            "header")]):
            magic, n = tf.unstack(tf.identity(gathered[pos:pos + 2]), 2)
        checks = [check(tf.equal(magic, wire.BUCKET_MAGIC), "has another header than a DGC "
                        "bucket: are all ranks running the same dgc_horovod version?"),
                  check(tf.equal(n, members), f"has a segment whose entry count differs from "
                        f"its {members} tensors")]
        with tf.control_dependencies(checks):
            pos = tf.identity(pos) + 2
    with tf.control_dependencies([check(pos + 1 <= total, "is truncated: missing an entry")]):
        member = tf.identity(gathered[pos])
    with tf.control_dependencies([check(tf.equal(member, j), f"names another member where "
                                        f"member {j} was expected (every rank sends every "
                                        f"member, in order)")]):
        return tf.identity(pos) + 1


@_plain
def global_clip_factor(grads, clip_norm, world_size, average):
    """:meth:`DGCCore.clip_scale` as graph ops (float32, as the eager TensorFlow path hands it
    to the core): min(1, T / (‖G‖ + 1e-6)) with ‖G‖ the float64 sum of the finite tensors'
    squared float32 norms, in order (inf when a finite tensor's norm overflows), T = C·√N
    (Average) or C/√N (Sum)."""
    total = tf.constant(0.0, tf.float64)
    overflow = tf.constant(False)
    for g in grads:
        g = tf.reshape(tf.cast(g, tf.float32), [-1])
        n = tf.cast(tf.norm(g), tf.float64)
        total = total + tf.where(tf.math.is_finite(n), n * n, 0.0)
        overflow = tf.logical_or(overflow, tf.logical_and(
            tf.math.is_inf(n), tf.reduce_all(tf.math.is_finite(g))))
    norm = tf.where(overflow, tf.constant(float("inf"), tf.float64), tf.sqrt(total))
    return tf.cast(tf.minimum(tf.constant(1.0, tf.float64), _threshold(clip_norm, world_size, average) / (norm + 1e-6)),
                   tf.float32)


def _threshold(clip_norm, world_size, average):
    """:func:`~dgc_horovod.core.accumulate.clip_threshold` for an int32 world-size tensor."""
    root = tf.sqrt(tf.cast(world_size, tf.float64))
    return clip_norm * root if average else clip_norm * (1.0 / root)


# --------------------------------------------------------------------------- the core
class _Step:
    """The ops of one traced reduction that every tensor's compression reads (step_ops)."""

    __slots__ = ("grads", "graph", "active", "step", "density", "world", "clip", "draws",
                 "buckets")


class GraphCore(DGCCore):
    """:class:`~dgc_horovod.core.DGCCore` on the TensorFlow backend whose compress / decompress
    are traced into the step's graph (module docstring). The warm-up position, the statistics
    and the states live in ``tf.Variable``\\ s the graphs update; every reader of the core
    (``steps``, ``density``, the statistics, ``state_dict``) sees them, and ``load_state_dict``,
    ``set_step`` and ``set_epoch`` write them.

    Trace-time API (the adapter's): :meth:`step_ops`, :meth:`compress_ops`,
    :meth:`decompress_ops`; the eager ``compress`` / ``decompress`` stay the core's.

    Args: config (DGCConfig), backend (the TensorFlow backend, TFBackend).
    """

    def __init__(self, config, backend):
        super().__init__(config, backend)
        self.use_kernels = False
        c = config
        with tf.init_scope():
            self._step_var = variable(0, tf.int64)
            self._epoch_density = variable(self.density, tf.float64)
            # 1 once set_epoch() was called or the graph has said that it never was
            self._epoch_called = variable(0, tf.int64)
        w = c.warmup_steps if c.warmup_epochs is None else 0
        self._densities = [density_at_step(i, c.compress_ratio, w, c.warmup_initial_density,
                                           c.warmup_per_step) for i in range(w + 1)]
        self._traced = {}       # name -> TensorState whose variables the graphs hold
        self._rows = {}         # name -> (row, acc): int64 variables of its statistics
        self._synced = 0        # the step counter when the statistics were last read
        self._last = None
        self._functions = {}    # (what, name, variant) -> its tf.function (_function)

    # ------------------------------------------------------- the variables <-> the core
    def _pull(self):
        """The graphs' step counter and statistics into the core (before it is read)."""
        steps = int(self._step_var.numpy())
        self._steps = steps
        if not self._rows:
            return
        rec = self._stats
        new = steps - self._synced
        step = CompressionStats() if new > 0 else None
        for name, (row, acc) in self._rows.items():
            added = acc.numpy()
            if added.any():
                acc.assign(tf.zeros_like(acc))
                for f, value in zip(FIELDS, added):
                    setattr(rec.total, f, getattr(rec.total, f) + int(value))
            last = row.numpy()
            if step is not None and last[-1] == steps:
                for f, value in zip(FIELDS, last[:-1]):
                    setattr(step, f, getattr(step, f) + int(value))
            self._warn_fp16(name, added)
        if step is not None:
            step.steps = 1
            step.density = rec.total.density = self.density
            rec.step = step
            rec.total.steps += new
            rec.restart()
        self._synced = steps

    def _warn_fp16(self, name, added):
        over, flushed = (int(added[FIELDS.index(f)]) for f in ("overflowed_entries",
                                                               "flushed_entries"))
        if flushed:
            self._warn_once("fp16_flush", (
                f"DGC: wire_values='float16': {flushed} selected non-zero value(s) of {name!r} "
                "were below float16's range (|v| <= 2**-25) and were sent as 0 (they stay in "
                "the residual). Further ones are counted in stats.flushed_entries. A larger "
                "loss scale, or wire_values='float32', sends them"))
        if over:
            self._warn_once("fp16_overflow", (
                f"DGC: wire_values='float16': {over} selected value(s) of {name!r} exceeded "
                "float16's range (|v| >= 65520; its largest value is 65504) and were sent as "
                "±inf, as a float16 cast does: every rank got a non-finite update for that "
                "step, which a loss scaler skips (then backing off its scale), and this rank "
                "dropped the tensor's DGC state (u and v restarted at zero). Further overflows "
                "are counted in stats.overflowed_entries. Use a smaller loss scale, or "
                "wire_values='float32'"))

    def _push_position(self):
        """The core's warm-up position into the variables the graphs read (after a load or
        set_step); the statistics rows restart (counted ones were read or replaced)."""
        self._step_var.assign(self._steps)
        self._synced = self._steps
        self._epoch_density.assign(DGCCore.density.fget(self))
        for row, acc in self._rows.values():
            row.assign(tf.fill(row.shape, tf.constant(-1, tf.int64)))
            acc.assign(tf.zeros_like(acc))

    def _push(self):
        """After a load: the position (:meth:`_push_position`), and a traced tensor takes its
        loaded u, v, wd (zeros when the checkpoint has none) into its variables, which then
        stand in the core's states again."""
        self._push_position()
        for name, st in self._traced.items():
            new = self.states.get(name)
            if new is st:
                continue
            for attr in ("u", "v", "wd"):
                var = getattr(st, attr)
                if var is not None:
                    loaded = None if new is None else getattr(new, attr)
                    var.assign(tf.zeros_like(var) if loaded is None
                               else tf.reshape(tf.cast(loaded, tf.float32), [-1]))
            self.states[name] = st

    steps = property(lambda self: (self._pull(), self._steps)[1], doc=DGCCore.steps.__doc__)
    step_stats = property(lambda self: (self._pull(), self._stats.step)[1],
                          doc=DGCCore.step_stats.__doc__)
    total_stats = property(lambda self: (self._pull(), self._stats.total)[1],
                           doc=DGCCore.total_stats.__doc__)

    @property
    def density(self):
        if hasattr(self, "_step_var"):
            self._steps = int(self._step_var.numpy())
        return DGCCore.density.fget(self)

    density.__doc__ = DGCCore.density.__doc__

    def state_dict(self, world_size=None, rank=None):
        self._pull()
        return super().state_dict(world_size, rank)

    def load_state_dict(self, state_dict, world_size=None, rank=None, reset_residuals=False):
        if self._traced:
            # the graphs exist and may not trace again: the loaded states must fit the
            # variables they hold, checked now, before anything changes
            tensors = checkpoint.read(self.B, self.config, state_dict, world_size, rank,
                                      reset_residuals)[0]
            if not reset_residuals:
                self._check_fit(FitCheck(tensors), list(self._traced))
            for name, (numel, sparse, *_) in tensors.items():
                st = self._traced.get(name)
                if st is not None and (numel, sparse) != (st.numel, st.sparse):
                    raise ValueError(
                        f"DGC state_dict: tensor {name!r} has {numel} elements "
                        f"({'sparse' if sparse else 'dense'}), but the traced step holds "
                        f"{st.numel} ({'sparse' if st.sparse else 'dense'}): not this model's")
        super().load_state_dict(state_dict, world_size, rank, reset_residuals)
        self._push()
        if self._traced:
            self._fit = FitCheck()

    def check_fit_traced(self, names, compressed):
        """At a trace after :meth:`load_state_dict` (``fit_pending``): a ValueError when a loaded
        state matches none of ``names`` (every variable Horovod reduces, name -> element count:
        a loaded state of another size too) or a ``compressed``
        name has no loaded state (:meth:`DGCCore.check_fit`); the check is then done."""
        self._check_fit(self._fit, names, compressed)
        self._fit = FitCheck()

    @staticmethod
    def _check_fit(fit, names, compressed=None):
        fit.check(names)
        for name in names if compressed is None else compressed:
            fit.check_name(name)

    def set_step(self, step, steps_per_epoch=None):
        self._pull()        # what the graphs counted so far, before the position moves
        super().set_step(step, steps_per_epoch)
        if self.config.warmup_epochs is None:
            self._push_position()

    def set_epoch(self, epoch):
        super().set_epoch(epoch)
        self._epoch_density.assign(DGCCore.density.fget(self))
        self._epoch_called.assign(1)

    state_dict.__doc__ = DGCCore.state_dict.__doc__
    load_state_dict.__doc__ = DGCCore.load_state_dict.__doc__

    # ------------------------------------------------------- trace time: the step
    @_plain
    def step_ops(self, grads, tensor, process_set, average):
        """The :class:`_Step` of the reduction Horovod is tracing (``grads``: its gradient list,
        ``tensor`` one of them), made at its first tensor in the graph that holds the gradients
        (not in the ``tf.cond`` branch Horovod traces each tensor's reduction in: every branch
        captures the same ops). ``process_set``: Horovod's (N: :func:`world_size_op`)."""
        graph = tensor.graph
        last = self._last
        if last is not None and last.grads is grads and last.graph is graph:
            return last
        c = self.config
        s = _Step()
        s.grads, s.graph, s.buckets = grads, graph, None
        with graph.as_default(), tf.name_scope("DGC_step"):
            # Horovod reduces only where its condition holds (_allreduce_cond: this rank in
            # the process set, more than one rank); where not, compress never runs and, as
            # in the eager core, the step does not count and no threshold is drawn
            s.active = active_op(process_set)
            s.step = tf.cond(s.active,
                             lambda: self._step_var.assign_add(1, read_value=True),
                             self._step_var.read_value)
            if c.warmup_epochs is None:
                at = tf.clip_by_value(s.step - 1, 0, len(self._densities) - 1)
                s.density = tf.gather(tf.constant(self._densities, tf.float64), at)
            else:
                s.density = self._epoch_density.read_value()
                if self._epoch_call_checked():
                    self._epoch_call_check(s)
            s.world = tf.cast(world_size_op(process_set), tf.int32)
            dense = [g.values if isinstance(g, tf.IndexedSlices) else g
                     for g in grads if g is not None]
            s.clip = (global_clip_factor(dense, c.clip_norm, s.world, average)
                      if self.needs_clip_scale else None)
            # the threshold samples of every sparsified tensor, in Horovod's order (the eager
            # core's draw order: one generator call per tensor that samples this step)
            s.draws = {}
            for g in grads:
                if g is None or isinstance(g, tf.IndexedSlices):
                    continue
                n = g.shape.num_elements()
                ns = sample_count(n, c)
                if ns and is_sparse(n, len(g.shape), c):
                    s.draws[id(g)] = tf.cond(
                        tf.logical_and(s.active, 2 * k_for(n, s.density) < n),
                        lambda ns=ns: self._generator.uniform([ns], dtype=tf.float64),
                        lambda ns=ns: tf.zeros([ns], tf.float64))
        self._last = s
        return s

    def _epoch_call_check(self, s):
        """The eager core's warning when an epoch-driven warm-up never gets set_epoch(), as
        ops: printed to stderr once, at the first step beyond EPOCH_CALL_CHECK_STEPS without a
        set_epoch() call."""
        def say():
            tf.print(tf.strings.format(self._epoch_call_missing("{}"), [s.density]),
                     output_stream=sys.stderr)
            return self._epoch_called.assign(1, read_value=True)

        late = tf.logical_and(s.step > compressor.EPOCH_CALL_CHECK_STEPS,
                              tf.equal(self._epoch_called, 0))
        tf.cond(late, say, self._epoch_called.read_value)

    def _traced_state(self, name, tensor):
        """The TensorState of ``name`` the graphs hold (made now, eagerly, at its first trace)."""
        st = self._traced.get(name)
        if st is None:
            with tf.init_scope():
                zeros = tf.zeros([tensor.shape.num_elements()], tf.float32)
                self.check_entry(name, zeros, zeros)
                st = self.states.get(name)
                if st is None:
                    st = self._state(name, tf.zeros(tensor.shape, tf.float32))
                else:       # loaded before the first trace: its values in new variables
                    st.u, st.v, st.wd = (None if t is None else self.B.float32_flat(t)
                                         for t in (st.u, st.v, st.wd))
                if self.separate_weight_decay and self.config.momentum > 0 and st.wd is None:
                    st.wd = self.B.zeros(st.numel)
                self._rows[name] = (
                    variable(tf.zeros([len(FIELDS) + 1], tf.int64)),
                    variable(tf.zeros([len(FIELDS)], tf.int64)))
            self._traced[name] = st
            self.states[name] = st
        return st

    # ------------------------------------------------------- trace time: one tensor
    def _function(self, what, name, variant, body):
        """The ``tf.function`` that holds ``what`` ("compress", "decompress") of tensor ``name``
        (or "bucket" of a tuple of names) for ``variant`` (op=Average or not; for a bucket also
        the process set, whose allgather it holds),
        made at its first trace and kept: a ``tf.function`` whose first run creates variables
        (DGC's, the optimizer's) is traced twice, and a second trace of the step calls the same
        functions again instead of rebuilding their thousands of ops. TensorFlow inlines them
        into the step when it optimises the graph. Its inputs are tensors (or None); it reads
        only the tensor's variables (its traced state, which stays the same object: a load
        assigns into it) and the core's."""
        key = (what, name, variant)
        fn = self._functions.get(key)
        if fn is None:
            fn = self._functions[key] = tf.function(body, autograph=False)
        return fn

    @_plain
    def compress_ops(self, name, grad, step, average=True, param=None):
        """Steps 2-5 for one gradient (any floating dtype and shape), in Horovod's branch:
        (kind, out, ctx). ``kind`` "dense": ``out`` the flat float32 velocity to allreduce;
        "sparse": the int32 payload to allgather. ``step``: :meth:`step_ops`'s; ``average``:
        op=Average (else Sum); ``param``: the variable (accumulated weight decay). The ops are
        those of a ``tf.function`` kept per tensor (:meth:`_function`)."""
        st = self._traced_state(name, grad)
        draws = step.draws.get(id(grad)) if not self.config.exact_topk else None

        def body(grad, density, clip, world, draws, param):
            return self._compress(st, average, grad, density, clip, world, draws, param)

        fn = self._function("compress", name, average, body)
        out, stats, sent = fn(grad, step.density, step.clip, step.world, draws, param)
        return ("sparse" if st.sparse else "dense"), out, (st, stats, sent)

    def _prepare(self, st, average, grad, clip, world, param):
        """The eager core's _accumulated: (the gradient as a flat float32, what momentum
        correction adds: s·g, + λ·w with ``weight_decay_mode="accumulated"``, whether the
        gradient is finite); ``clip``, ``world``: :meth:`step_ops`'s."""
        c = self.config
        g = tf.reshape(tf.cast(grad, tf.float32), [-1])
        scale = clip
        if c.clip_norm is not None and c.clip_scope == "tensor":
            norm = tf.cast(tf.norm(g), tf.float64)
            scale = tf.cast(tf.minimum(tf.constant(1.0, tf.float64), _threshold(c.clip_norm, world, average)
                                       / (norm + 1e-6)), tf.float32)
        if self.needs_param:
            w = tf.reshape(tf.cast(param, tf.float32), [-1])
            g = (g if scale is None else g * scale) + c.weight_decay * w
            scale = None
        acc = g if scale is None else g * scale     # momentum correction's s·g
        return g, acc, tf.reduce_all(tf.math.is_finite(g))

    def _compress(self, st, average, grad, density, clip, world, draws, param):
        """:meth:`compress_ops`'s ops: (out, the statistics row, the sent entries or None);
        ``density``, ``clip``, ``world``: :meth:`step_ops`'s."""
        c = self.config
        n = st.numel
        g, acc, finite = self._prepare(st, average, grad, clip, world, param)
        if not st.sparse:
            out = tf.cond(finite, lambda: self._velocity(st, acc), lambda: g)
            stats = tf.stack([tf.constant(v, tf.int64)
                              for v in [1, 0, n, 0, 4 * n, 4 * n, 4 * n]]
                             + [tf.cast(tf.logical_not(finite), tf.int64)]
                             + [tf.constant(0, tf.int64)] * 2)
            return out, stats, None
        k = k_for(n, density)

        def chosen():
            accumulate(self.B, st, acc, c)
            # delta16 needs the positions ascending: select gives them so; int32 sends them
            # in top_k's order, as the eager core does
            return select(tf.abs(st.v), k, draws, ascending=c.wire_index == "delta16")

        # non-finite: nothing sent, the state untouched
        return self._emit(st, tf.cond(finite, chosen, lambda: tf.zeros([0], tf.int64)), finite)

    def _emit(self, st, idx, finite):
        """Steps 4-5 of a sparsified tensor whose positions ``idx`` were selected (none where the
        gradient is not ``finite``): their values, momentum factor masking (§3.2,
        :func:`~dgc_horovod.core.accumulate.clear_sent`), float16 rounding, the payload (flagged
        non-finite where it is not). Returns (payload, the statistics row, the sent entries:
        (idx, values, u at idx, whether to put them back after a bad step))."""
        c, B = self.config, self.B
        n = st.numel
        vals = tf.gather(st.v, idx)
        masked = c.momentum_masking and st.u is not None
        u_sent = tf.gather(st.u, idx) if masked else tf.zeros([0], tf.float32)
        clear_sent(B, st.u, st.v, idx, c.momentum_masking)
        counts = tf.zeros([2], tf.int64)
        keep, sent = finite, vals
        if c.wire_values == "float16":
            sent, keep, counts = self._round_to_fp16(st, idx, vals)
            keep = tf.logical_and(keep, finite)
        flags = tf.where(finite, 0, wire.FLAG_NONFINITE)
        payload = encode(n, idx, sent, flags, c.wire_index, c.wire_values)
        words = tf.size(payload, out_type=tf.int64)
        stats = tf.concat([tf.constant([1, 1, n], tf.int64),
                           tf.stack([tf.size(idx, out_type=tf.int64), 4 * words,
                                     tf.constant(0, tf.int64),
                                     tf.constant(4 * n, tf.int64),
                                     tf.cast(tf.logical_not(finite), tf.int64)]), counts], 0)
        return payload, stats, (idx, vals, u_sent, keep)

    @_plain
    def plan_ops(self, entries, step, process_set, average):
        """Every bucket of this traced reduction, as the adapter plans them: ``entries``
        (name, gradient, variable or None) in Horovod's order, cut by
        :func:`~dgc_horovod.core.buckets.plan_buckets` (``bucket_numel``; 0: no buckets, one
        allgather per tensor), each bucket's sparsified members through :meth:`bucket_ops`.
        Returns {name: (ctx, result)} of the members."""
        out = {}
        if not self.config.bucket_numel or not entries:
            return out
        by_name = {entry[0]: entry for entry in entries}
        plan = plan_buckets([(name, g.shape.num_elements(), len(g.shape))
                             for name, g, _ in entries], self.config.bucket_numel, self.config)
        for members, _ in plan:
            sent = [by_name[name] for name in members
                    if self._traced_state(name, by_name[name][1]).sparse]
            if sent:
                out.update(zip([name for name, _, _ in sent],
                               self.bucket_ops(sent, step, process_set, average)))
        return out

    @_plain
    def bucket_ops(self, entries, step, process_set, average):
        """Steps 2-6 of a bucket's sparsified members, in the graph that holds the gradients
        (outside Horovod's per-tensor branches, which cannot share ops): each member's compress
        (:meth:`compress_ops`' ops), the payloads framed into one segment
        (:func:`frame_bucket`), one ``hvd.allgather`` for the bucket (named after its first
        member), and :func:`decode_bucket`. Where Horovod does not reduce this step (``step.
        active`` False) none of it runs. ``entries``: (name, gradient, variable or None) per
        member, in member order. Returns per member (ctx, result) for :meth:`decompress_ops`:
        ``result`` (the decoded sum, non-finite, received bytes); the statistics row's sent bytes
        include the member's framing words. The same payloads, updates and state as one
        allgather per tensor, bit for bit; the ops are those of a ``tf.function`` kept per
        bucket (:meth:`_function`)."""
        names = [name for name, _, _ in entries]
        sts = [self._traced_state(name, g) for name, g, _ in entries]
        draws = [None if self.config.exact_topk else step.draws.get(id(g))
                 for _, g, _ in entries]
        label = "bucket." + names[0]

        def body(grads, density, clip, world, draws, params):
            outs = [self._compress(st, average, g, density, clip, world, d, p)
                    for st, g, d, p in zip(sts, grads, draws, params)]
            gathered = hvd.allgather(frame_bucket([o[0] for o in outs]),
                                     name=collective_name(label), process_set=process_set)
            decoded = decode_bucket(gathered, [st.numel for st in sts], names, world, label)
            result = []
            for j, ((payload, stats, sent), (dense, bad, words)) in enumerate(zip(outs, decoded)):
                framing = 3 if j == 0 else 1    # the member word (and the bucket header)
                own = tf.size(payload, out_type=tf.int64) + framing
                stats = tf.tensor_scatter_nd_add(stats, [[_WIRE]],
                                                 tf.constant([4 * framing], tf.int64))
                result.append((stats, sent, (dense, bad, 4 * (words - own))))
            return result

        fn = self._function("bucket", tuple(names), (average, process_set.process_set_id), body)
        args = ([g for _, g, _ in entries], step.density, step.clip, step.world, draws,
                [p for _, _, p in entries])
        with step.graph.as_default(), tf.name_scope("DGC_bucket"):
            if tf.get_static_value(step.active):       # (numpy's True)
                result = fn(*args)
            else:       # an elastic job, or this rank outside the process set
                result = tf.cond(step.active, lambda: fn(*args),
                                 lambda: [self._idle(st) for st in sts])
        return [((st, stats, sent), decoded) for st, (stats, sent, decoded) in zip(sts, result)]

    @staticmethod
    def _idle(st):
        """A bucket member's :meth:`bucket_ops` outputs where Horovod does not reduce (unused)."""
        empty, none = tf.zeros([0], tf.float32), tf.zeros([0], tf.int64)
        return (tf.zeros([len(FIELDS)], tf.int64), (none, empty, empty, tf.constant(False)),
                (tf.zeros([st.numel], tf.float32), tf.constant(False), tf.constant(0, tf.int64)))

    def _round_to_fp16(self, st, idx, vals):
        """:func:`~dgc_horovod.core.precision.round_to_fp16` as ops: (the values to send, whether
        the sent entries are put back after a bad step, [overflowed, flushed])."""
        sent = tf.cast(tf.cast(vals, tf.float16), tf.float32)
        overflowed = tf.size(vals, out_type=tf.int64) - tf.math.count_nonzero(
            tf.abs(sent) != float("inf"), dtype=tf.int64)
        flushed = tf.math.count_nonzero((sent == 0.0) & (vals != 0.0), dtype=tf.int64)

        def drop():                 # this rank overflowed: its u and v restart at zero
            for t in (st.u, st.v):
                if t is not None:
                    self.B.mul_(t, 0.0)
            return tf.constant(False)

        def residual():             # the rounding error stays in the residual
            self.B.scatter_(st.v, idx, vals - sent)
            return tf.constant(True)

        keep = tf.cond(overflowed > 0, drop, residual)
        return sent, keep, tf.stack([overflowed, flushed])

    def _velocity(self, st, g):
        """A dense tensor's velocity for the allreduce, v = 0 + u after u ← m·u + g (Nesterov
        v = (0 + g) + m·u; m = 0: 0 + g): the eager core's _compress_dense, with its zeros."""
        c = self.config
        v = tf.zeros_like(g)
        if st.u is None:
            return v + g
        self.B.scale_add_(st.u, c.momentum, g, 1.0)
        if c.nesterov:
            return (v + g) + c.momentum * tf.convert_to_tensor(st.u)
        return v + tf.convert_to_tensor(st.u)

    @_plain
    def decompress_ops(self, name, result, ctx, step, words, average, param=None):
        """Step 6, in Horovod's branch: the flat float32 update of ``name`` from ``result`` (the
        allgathered payloads of a sparsified tensor, or the allreduced velocity of a dense one,
        or a bucket member's decoded tuple from :meth:`bucket_ops`). ``words``: this rank's
        payload length (int32 words), for the statistics. The ops are those of a
        ``tf.function`` kept per tensor (:meth:`_function`)."""
        st, stats, sent = ctx

        def body(result, stats, sent, world, step_count, words, param):
            return self._decompress(name, st, average, result, stats, sent, world, step_count,
                                    words, param)

        fn = self._function("decompress", name, average, body)
        return fn(result, stats, sent, step.world, step.step, words, param)

    def _decompress(self, name, st, average, result, stats, sent, world, step_count, words,
                    param):
        """:meth:`decompress_ops`'s ops; ``world``, ``step_count``: :meth:`step_ops`'s."""
        c = self.config
        if sent is None:
            update = result
            received = tf.constant(0, tf.int64)
        else:
            idx, vals, u_sent, keep = sent
            if isinstance(result, tuple):       # a bucket's member, decoded by bucket_ops
                dense, nonfinite, received = result
            else:
                dense, nonfinite = decode_sum(result, st.numel, world, name)
                received = 4 * (tf.size(result, out_type=tf.int64) - words)

            def bad():
                def put_back():
                    self.B.scatter_(st.v, idx, vals)
                    if st.u is not None and c.momentum_masking:
                        self.B.scatter_(st.u, idx, u_sent)
                    return tf.constant(0)
                tf.cond(keep, put_back, lambda: tf.constant(0))
                return dense * float("nan")

            def good():
                if average:
                    return tf.cond(world > 1, lambda: dense * tf.cast(
                        1.0 / tf.cast(world, tf.float64), tf.float32), lambda: dense)
                return dense

            update = tf.cond(nonfinite, bad, good)
        row, acc = self._rows[name]
        stats = tf.tensor_scatter_nd_add(stats, [[_RECEIVED]], [received])
        row.assign(tf.concat([stats, [step_count]], 0))
        acc.assign_add(stats)
        if self.separate_weight_decay:
            w = tf.reshape(tf.cast(param, tf.float32), [-1])
            update = tf.cond(tf.reduce_all(tf.math.is_finite(update)),
                             lambda: self._weight_decay(st, update, w), lambda: update)
        return update

    def _weight_decay(self, st, update, w):
        """``weight_decay_mode="separate"`` on a finite update (the eager
        :meth:`~DGCCore.apply_weight_decay`): b ← m·b + λ·w; update + b (Nesterov:
        update + λ·w + m·b; m = 0: update + λ·w)."""
        c = self.config
        lam = c.weight_decay
        if st.wd is None:
            return update + lam * w
        self.B.scale_add_(st.wd, c.momentum, w, lam)
        b = tf.convert_to_tensor(st.wd)
        if c.nesterov:
            return (update + lam * w) + c.momentum * b
        return update + b


def accumulate(B, st, g, config):
    """Momentum correction (§3.1, eq. 5-6) on the tensor's variables, g already scaled by the
    clipping factor: :func:`~dgc_horovod.core.accumulate.momentum_correction`; classic momentum as
    one fused kernel, ``ResourceApplyMomentum`` with learning rate -1 (u ← u·m + g; v ← v + u:
    on a CPU the same roundings as the two ops, checked bit for bit by tests/test_tf_graph.py;
    on a GPU the kernel may fuse u·m + g into one rounding)."""
    if config.momentum == 0.0 or config.nesterov:
        momentum_correction(B, st.u, st.v, g, config.momentum, config.nesterov)
        return
    tf.raw_ops.ResourceApplyMomentum(var=st.v.handle, accum=st.u.handle,
                                     lr=tf.constant(-1.0, tf.float32), grad=g,
                                     momentum=tf.constant(config.momentum, tf.float32),
                                     use_locking=False, use_nesterov=False)


def active_op(process_set):
    """Whether Horovod reduces in this step: its ``_allreduce_cond``'s condition (this rank in
    the process set and more than one rank), as ops under ``HOROVOD_ELASTIC=1``."""
    if int(os.environ.get("HOROVOD_ELASTIC", 0)):
        ps = process_set.process_set_id
        return tf.logical_and(tf.equal(hvd.process_set_included_op(ps), 1),
                              tf.greater(hvd.size_op(ps), 1))
    return tf.constant(bool(process_set.included() and process_set.size() > 1))


def world_size_op(process_set):
    """N for the graph: Horovod's size op under ``HOROVOD_ELASTIC=1`` (a reset changes it without
    a retrace, as Horovod's own reduction reads it), else the process set's size now."""
    if int(os.environ.get("HOROVOD_ELASTIC", 0)):
        return hvd.size_op(process_set.process_set_id)
    return process_set.size()


class GraphPath:
    """The adapter's side of ``DGC(in_graph=True)``: a gradient Horovod hands over, once the
    adapter has located its variable and checked it, goes through :class:`GraphCore`'s steps
    and Horovod's collectives, all ops of the traced step. A sparsified tensor's payload goes
    through ``hvd.allgather``, its bucket's (:meth:`GraphCore.bucket_ops`) or its own
    (``bucket_numel=0``), and Horovod's allreduce carries a 1-element placeholder; a dense
    tensor's velocity goes through Horovod's allreduce itself."""

    def __init__(self, dgc):
        self.core, self._names = dgc._core, dgc._names

    def compress(self, tensor, var, name, reduced, process_set, average):
        """Trace-time: (the tensor Horovod allreduces, ctx)."""
        core = self.core
        grads, variables = reduced
        if core.fit_pending:        # the first trace after load_state_dict
            pairs = [(g, v) for g, v in zip(grads, variables) if g is not None]
            core.check_fit_traced(self._names.sizes([v for _, v in pairs]), [
                self._names.of(v) for g, v in pairs if not isinstance(g, tf.IndexedSlices)])
        step = core.step_ops(grads, tensor, process_set, average)
        member = self._buckets(step, grads, variables, process_set, average).get(id(tensor))
        if member is not None:      # its bucket's ops are in the graph (GraphCore.bucket_ops)
            # Horovod's allreduce gets a placeholder, pruned as below
            return tf.zeros([1], tensor.dtype), (name, tensor, var, step, member[0],
                                                 (member[1], None), average)
        kind, out, ctx = core.compress_ops(name, tensor, step, average,
                                       var if core.needs_param else None)
        if kind == "dense":
            return (tf.cast(tf.reshape(out, tensor.shape), tensor.dtype),
                    (name, tensor, var, step, ctx, None, average))
        gathered = hvd.allgather(out, name=collective_name(name), process_set=process_set)
        # Horovod allreduces what compress returns: a 1-element placeholder, whose result
        # decompress does not use, so TensorFlow prunes that allreduce from the step (on every
        # rank alike: the ranks trace the same step) and nothing is sent for it
        placeholder = tf.cast(out[2:3], tensor.dtype)
        return placeholder, (name, tensor, var, step, ctx,
                             (gathered, tf.size(out, out_type=tf.int64)), average)

    def _buckets(self, step, grads, variables, process_set, average):
        """{id(gradient): its member of :meth:`GraphCore.plan_ops`} for the sparsified
        gradients of this traced reduction, made at its first tensor from Horovod's gradients
        (not IndexedSlices, with a static size), in its order."""
        if step.buckets is None:
            entries = [(self._names.of(v), g, v if self.core.needs_param else None)
                       for g, v in zip(grads, variables)
                       if g is not None and not isinstance(g, tf.IndexedSlices)
                       and g.shape.num_elements() is not None]
            grad_of = {name: g for name, g, _ in entries}
            step.buckets = {id(grad_of[name]): member for name, member in
                            self.core.plan_ops(entries, step, process_set, average).items()}
        return step.buckets

    def decompress(self, tensor, ctx):
        """Trace-time: the update of the gradient ``ctx`` describes, in its shape and dtype."""
        name, original, var, step, core_ctx, gathered, average = ctx
        if gathered is None:
            result, words = tf.reshape(tf.cast(tensor, tf.float32), [-1]), 0
        else:       # the placeholder Horovod allreduced is not used (module docstring)
            result, words = gathered        # (a bucket member: its decoded tuple, None)
        update = self.core.decompress_ops(name, result, core_ctx, step, words, average,
                                      var if self.core.separate_weight_decay else None)
        return tf.cast(tf.reshape(update, original.shape), original.dtype)
