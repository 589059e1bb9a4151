"""DGC's per-step work as TensorFlow graph ops, traced into the step's ``tf.function``: no
``tf.py_function``, no Python per step (the TensorFlow adapter's default, ``DGC(in_graph=True)``).

The state is the core's (:class:`GraphCore` is a :class:`~dgc_horovod.core.DGCCore` whose
tensors are ``tf.Variable``\\ s of the TensorFlow backend); the steps are those of the engine
contract (:mod:`dgc_horovod.core.engine`) as graph ops, with every rule, constant and size from
``core/``: the plan, hash and selection rule of :mod:`~dgc_horovod.core.sparsify` (its integer
functions run on the graph's int64 tensors unchanged), the payload layout and sizes of
:mod:`~dgc_horovod.core.wire`, the arithmetic of :mod:`~dgc_horovod.core.accumulate`. In order
(Lin et al. 2018, Algorithm 1):

1. **step** (:meth:`GraphCore.step_ops`, once per traced reduction, in the graph that holds the
   gradients): the step counter, a ``tf.Variable``, advances; with the seed and the tensor it
   fixes the samples (:func:`~dgc_horovod.core.sparsify.sample_base`), and with the
   step-counted warm-up (§3.3) the density: each tensor's plan (k, s, ks1, ks2, cap) is
   evaluated at trace time for each density of :func:`~dgc_horovod.core.warmup.
   density_at_step` and the graph picks the step's (with ``warmup_epochs`` the plan is a
   variable that :meth:`GraphCore.set_epoch` sets: the density changes only there). Also N and
   the local clipping factor over all of the rank's gradients (§3.2, ``clip_scope="global"``);
2. **clip and accumulate** (§3.1-3.2, :meth:`GraphCore.compress_ops`): s·g (+ λ·w with
   ``weight_decay_mode="accumulated"``), then momentum correction (:func:`accumulate`); a
   gradient with NaN/Inf leaves the state untouched;
3. **select** (§5, :func:`select`); 4. **mask** (§3.2, :func:`~dgc_horovod.core.accumulate.
   clear_sent`), float16 rounding as :func:`~dgc_horovod.core.precision.round_to_fp16`;
5. **encode** (:func:`encode`): :func:`~dgc_horovod.core.wire.payload_words` (n, k) words; in
   buckets (``bucket_numel``, :meth:`GraphCore.plan_ops`, the default) a bucket's payloads
   framed into one segment (:func:`frame_bucket`) for one ``hvd.allgather``;
6. after Horovod's allgather, **decode and average** (:func:`decode_sum`, :func:`decode_bucket`,
   :meth:`GraphCore.decompress_ops`): every rank's payload summed in rank order, times
   float32(1/N) under ``op=hvd.Average``; after a non-finite step NaN everywhere and this rank's
   sent entries put back; then the separate weight decay (``weight_decay_mode="separate"``).

Horovod's conventions map onto the paper's as in the eager core
(:mod:`dgc_horovod.core.compressor`). On a CPU the results are the eager core's reference
engine's, bit for bit: payloads, state, updates, statistics (``tests/test_tf_graph.py``, every
option); on a GPU not measured (no GPU machine here has Horovod).

A step is one run of a traced reduction in which Horovod reduces (its ``_allreduce_cond``
holds: this rank in the process set, more than one rank): the step counter and the warm-up
advance then, as when the eager core's compress runs. A training step that runs two reductions
(two ``tape.gradient`` calls) counts two steps, where the eager core counts one if the two
reduce different variables (a GAN's two models): there the step-counted warm-up advances twice
as fast in the graph. Not done per step: ``compress_seconds`` is 0 (no clock in the graph); the
statistics are counted in ``tf.Variable``\\ s, one row per tensor, and read when ``dgc.stats``
is; float16 overflow / flush warnings are given when the statistics (or a checkpoint) are read;
the warning that an epoch-driven warm-up never got ``set_epoch()`` is printed to stderr by the
step.
"""
import sys

import horovod.tensorflow as hvd
import tensorflow as tf

from dgc_horovod.adapter import under_elastic
from dgc_horovod.backends.tf_backend import TFBackend, variable
from dgc_horovod.core import DGCCore, checkpoint, compressor, precision, sparsify, wire
from dgc_horovod.core import accumulate as core_accumulate
from dgc_horovod.core.accumulate import clear_sent, momentum_correction, restore_sent
from dgc_horovod.core.buckets import plan_buckets
from dgc_horovod.core.checkpoint import FitCheck
from dgc_horovod.core.stats import CompressionStats
from dgc_horovod.core.warmup import density_at_step
from dgc_horovod.tensorflow.variables import collective_name

__all__ = ["GraphCore", "GraphPath", "select", "encode", "decode_sum", "frame_bucket",
           "decode_bucket", "global_clip_factor"]

#: DGC's graph functions are traced as written: AutoGraph must not rewrite their Python control
#: flow, which depends only on settings and static shapes
_plain = tf.autograph.experimental.do_not_convert
#: The statistics one tensor adds per step, in the order of its row (int64 tf.Variable).
FIELDS = ("tensors", "sparse_tensors", "elements", "selected", "wire_bytes", "received_bytes",
          "dense_bytes", "nonfinite_tensors", "overflowed_entries", "flushed_entries")
_RECEIVED = FIELDS.index("received_bytes")
_WIRE = FIELDS.index("wire_bytes")


class _Bits32(TFBackend):
    """The TensorFlow backend (whose ops are graph ops too) for sparsify's functions; its
    :func:`~dgc_horovod.core.sparsify.magnitude_bits` stay int32 (they fit in 31 bits): half
    the bytes of int64 in the passes over a tensor."""

    def to_int64(self, x): return x


_B = _Bits32()


# --------------------------------------------------------------------------- the steps as ops
def plan_row(n, density, config):
    """The :func:`~dgc_horovod.core.sparsify.plan` of a tensor of n elements as the int64 row
    the graph reads: [k, s, ks1, ks2, cap]."""
    p = sparsify.plan(n, density, config)
    return [p.k, p.s, p.ks1, p.ks2, p.cap]


@_plain
def select(v, n, plan, base):
    """:func:`~dgc_horovod.core.sparsify.select` as graph ops, without a host read: the
    positions of ``v`` (float32, n elements) the rule sends, ascending (int64). ``plan``: int64
    [k, s, ks1, ks2, cap] (:func:`plan_row`); ``base``: the tensor's
    :func:`~dgc_horovod.core.sparsify.sample_base` (an int64 scalar tensor)."""
    k, s, ks1, ks2, cap = tf.unstack(plan, 5)
    bits = sparsify.magnitude_bits(_B, v)
    sampled = tf.gather(bits, sparsify.sample_positions(_B, base, s, n, None))
    # the ks-th largest sample: one top-k of the samples and a 0 (below every magnitude), so
    # that without samples (s = ks1 = ks2 = 0) both thresholds are MIN_BITS
    top = tf.math.top_k(tf.concat([sampled, tf.zeros([1], tf.int32)], 0),
                        tf.cast(tf.maximum(ks2, 1), tf.int32)).values
    t1, t2 = (tf.maximum(top[tf.maximum(ks, 1) - 1], sparsify.MIN_BITS) for ks in (ks1, ks2))
    # the level: t1 if at least k magnitudes reach it, else t2 (a second pass, rarely)
    cand = tf.reshape(tf.where(bits >= t1), [-1])                   # ascending
    cand = tf.cond(tf.size(cand, out_type=tf.int64) >= k, lambda: cand,
                   lambda: tf.reshape(tf.where(bits >= t2), [-1]))[:cap]
    # the k largest by (magnitude, then the lower position): distinct int64 keys in the order
    # of sparsify.select's (magnitude · 2**32 minus the position)
    keys = tf.cast(tf.gather(bits, cand), tf.int64) * 2 ** 32 - cand
    top = tf.math.top_k(keys, tf.cast(tf.minimum(k, tf.size(cand, out_type=tf.int64)),
                                      tf.int32), sorted=False).indices
    return tf.sort(tf.gather(cand, top))


def _pack16(tokens):
    """Values in 0..65535 (or float16 bit patterns) as int32 words, two a word, low half first,
    a zero appended to an odd count: the TensorFlow backend's pack16."""
    t = tf.pad(tokens, [[0, tf.size(tokens) % 2]])
    return tf.bitcast(tf.reshape(t, [-1, 2]), tf.int32)


def _padded(words, size):
    """int32 ``words`` followed by zeros up to ``size`` words (a scalar tensor)."""
    return tf.pad(words, [[0, tf.cast(size, tf.int32) - tf.size(words)]])


@_plain
def encode(numel, idx, values, k, flags=0, index="delta16", value_dtype="float32"):
    """:func:`dgc_horovod.core.wire.encode` as graph ops, the same words: ``idx`` int64
    positions (ascending), ``values`` float32 in their order, ``k`` the capacity (an int or an
    int64 scalar tensor), ``flags`` an int or an int32 scalar tensor; the int32 payload of
    :func:`~dgc_horovod.core.wire.payload_words` (numel, k) words."""
    c = tf.size(idx)
    k = tf.cast(k, tf.int64)
    if index == "int32":
        tokens, idx_words = c, tf.cast(idx, tf.int32)
    else:
        prev = tf.concat([tf.constant([-1], tf.int64), idx], 0)[:-1]
        gaps = idx - prev                                   # >= 1
        escapes = (gaps - 1) // wire.ESCAPE
        ends = tf.cumsum(escapes + 1)                       # tokens up to each entry
        n_tokens = tf.reduce_sum(escapes + 1)
        # no gap beyond ESCAPE (the common case): the tokens are the gaps
        toks = tf.cond(tf.equal(n_tokens, tf.size(idx, out_type=tf.int64)), lambda: gaps,
                       lambda: tf.scatter_nd(tf.reshape(ends - 1, [-1, 1]),
                                             gaps - escapes * wire.ESCAPE,
                                             tf.reshape(n_tokens, [1])))
        tokens = tf.cast(n_tokens, tf.int32)
        idx_words = _pack16(tf.cast(toks, tf.uint16))
    if value_dtype == "float32":
        val_words = tf.bitcast(values, tf.int32)
    else:
        val_words = _pack16(tf.cast(values, tf.float16))
    word3 = tf.bitwise.bitwise_or(tf.cast(flags, tf.int32),
                                  wire.INDEX_ENCODINGS.index(index) << 8
                                  | wire.VALUE_DTYPES.index(value_dtype) << 16)
    header = tf.stack([tf.constant(wire.MAGIC_V3, tf.int32), tf.constant(numel, tf.int32), c,
                       word3, tokens, tf.cast(k, tf.int32)])
    return tf.concat([header, _padded(idx_words, wire.index_words(numel, k, index)),
                      _padded(val_words, wire.value_words(k, value_dtype))], 0)


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
    a float16 value beyond float16's range). Asserts name the tensor, the rank and the fault;
    the sizes are computed in int64 (a header cannot wrap them around)."""
    with tf.control_dependencies([_check(pos + wire.HEADER_WORDS <= total, name,
                                         "is truncated: no complete header", rank)]):
        head = tf.identity(gathered[pos:pos + wire.HEADER_WORDS])
    magic, n, c, word3, t, k = tf.unstack(tf.cast(head, tf.int64), wire.HEADER_WORDS)
    bits = tf.bitwise
    flags = bits.bitwise_and(word3, 0xFF)
    icode = bits.bitwise_and(bits.right_shift(word3, 8), 0xFF)
    vcode = bits.bitwise_and(bits.right_shift(word3, 16), 0xFF)
    int32_idx, fp32 = tf.equal(icode, 0), tf.equal(vcode, 0)
    start = tf.cast(pos, tf.int64) + wire.HEADER_WORDS
    vstart = start + tf.where(int32_idx, wire.index_words(n, k, "int32"),
                              wire.index_words(n, k, "delta16"))
    end = vstart + tf.where(fp32, wire.value_words(k, "float32"), wire.value_words(k, "float16"))
    known = tf.logical_and(tf.logical_and(icode < len(wire.INDEX_ENCODINGS),
                                          vcode < len(wire.VALUE_DTYPES)),
                           tf.equal(bits.right_shift(word3, 24), 0))
    checks = [
        _check(tf.equal(magic, wire.MAGIC_V3), name, "has another header than DGC wire format "
               "v3: are all ranks running the same dgc_horovod version?", rank),
        _check(tf.equal(n, numel), name, f"describes another number of elements than this "
               f"rank's {numel}: the models differ", rank),
        _check(tf.logical_and(0 <= c, tf.logical_and(c <= k, k <= n)), name,
               "claims more entries than it has room for, or room for more than the tensor's "
               "elements", rank),
        _check(known, name, "has an unknown encoding word", rank),
        _check(tf.logical_and(tf.logical_or(tf.logical_not(int32_idx), tf.equal(t, c)),
                              tf.logical_and(c <= t, t <= c + wire.max_escapes(n))), name,
               "has an index token count that does not fit its entries", rank),
        _check(end <= tf.cast(total, tf.int64), name, "is truncated", rank)]
    with tf.control_dependencies(checks):       # from here on every size is in range
        start, vstart, end, c, t = (tf.cast(x, tf.int32) for x in (start, vstart, end, c, t))
        iw = gathered[start:start + tf.where(int32_idx, c, (t + 1) // 2)]
        vw = gathered[vstart:vstart + tf.where(fp32, c, (c + 1) // 2)]

    def delta16():
        toks = tf.cast(tf.reshape(tf.bitcast(iw, tf.uint16), [-1])[:t], tf.int64)

        def escaped():
            is_entry = toks != 0
            return tf.boolean_mask(tf.cumsum(tf.where(is_entry, toks, wire.ESCAPE)) - 1,
                                   is_entry)

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
    to the core): ‖G‖ the float64 sum of the finite tensors' squared float32 norms, in order
    (inf when a finite tensor's norm overflows), then :func:`clip_factor`."""
    total = tf.constant(0.0, tf.float64)
    overflow = tf.constant(False)
    for g in grads:
        g = tf.reshape(tf.cast(g, tf.float32), [-1])
        n = tf.cast(tf.norm(g), tf.float64)
        total = total + tf.where(tf.math.is_finite(n), n * n, 0.0)
        overflow = tf.logical_or(overflow, tf.logical_and(
            tf.math.is_inf(n), tf.reduce_all(tf.math.is_finite(g))))
    norm = tf.where(overflow, tf.constant(float("inf"), tf.float64), tf.sqrt(total))
    return clip_factor(norm, clip_norm, world_size, average)


def clip_factor(norm, clip_norm, world_size, average):
    """:func:`~dgc_horovod.core.accumulate.clip_factor` of the float64 ``norm`` with the
    threshold of :func:`~dgc_horovod.core.accumulate.clip_threshold` (C·√N under Average, C/√N
    under Sum) for an int32 world-size tensor, both on graph ops, as float32."""
    threshold = core_accumulate.clip_threshold(clip_norm, tf.cast(world_size, tf.float64),
                                               average, tf.sqrt)
    minimum = (lambda one, x: tf.minimum(tf.constant(one, tf.float64), x))
    return tf.cast(core_accumulate.clip_factor(norm, threshold, minimum), tf.float32)


# --------------------------------------------------------------------------- the core
class _Step:
    """The ops of one traced reduction that every tensor's compression reads (step_ops)."""

    __slots__ = ("grads", "graph", "active", "step", "at", "world", "clip", "buckets")


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
        c = config
        with tf.init_scope():
            self._step_var = variable(0, tf.int64)
            self._epoch_density = variable(self.density, tf.float64)
            # 1 once set_epoch() was called or the graph has said that it never was
            self._epoch_called = variable(0, tf.int64)
        # the step-counted warm-up: its distinct densities, and which one each step has (None:
        # warmup_epochs)
        self._densities = self._level = None
        if c.warmup_epochs is None:
            steps = [density_at_step(i, c.compress_ratio, c.warmup_steps,
                                     c.warmup_initial_density, c.warmup_per_step)
                     for i in range(max(c.warmup_steps, 0) + 1)]
            self._densities = list(dict.fromkeys(steps))         # distinct, in order
            index = {d: i for i, d in enumerate(self._densities)}
            self._level = [index[d] for d in steps]
        self._seed = sparsify.seed_key(c.seed)
        self._plans = {}        # warmup_epochs: name -> its plan_row variable (set_epoch sets)
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
            for key, message in precision.warning(name, *(int(added[FIELDS.index(f)]) for f in (
                    "overflowed_entries", "flushed_entries"))):
                self._warn_once(key, message)
        if step is not None:
            step.steps = 1
            step.density = rec.total.density = self.density
            rec.step = step
            rec.total.steps += new
            rec.restart()
        self._synced = steps

    def _push_position(self):
        """The core's warm-up position into the variables the graphs read (after a load or
        set_step); the statistics rows restart (counted ones were read or replaced)."""
        self._step_var.assign(self._steps)
        self._synced = self._steps
        self._push_density()
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
        self._push_density()
        self._epoch_called.assign(1)

    def _push_density(self):
        """The density in force into the variables the graphs read with ``warmup_epochs``: each
        traced tensor's plan (:func:`plan_row`), and the density the warning names."""
        density = DGCCore.density.fget(self)
        self._epoch_density.assign(density)
        for name, var in self._plans.items():
            var.assign(plan_row(self._traced[name].numel, density, self.config))

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
            # in the eager core, the step does not count
            s.active = active_op(process_set)
            s.step = tf.cond(s.active,
                             lambda: self._step_var.assign_add(1, read_value=True),
                             self._step_var.read_value)
            s.at = None         # warmup_epochs: the plans are variables (set_epoch)
            if self._level is not None:     # the step's density in the warm-up's table
                s.at = tf.gather(tf.constant(self._level, tf.int64),
                                 tf.clip_by_value(s.step - 1, 0, len(self._level) - 1))
            elif self._epoch_call_checked():
                self._epoch_call_check(s)
            s.world = tf.cast(world_size_op(process_set), tf.int32)
            dense = [g.values if isinstance(g, tf.IndexedSlices) else g
                     for g in grads if g is not None]
            s.clip = (global_clip_factor(dense, c.clip_norm, s.world, average)
                      if self.needs_clip_scale else None)
        self._last = s
        return s

    def _epoch_call_check(self, s):
        """The eager core's warning when an epoch-driven warm-up never gets set_epoch(), as
        ops: printed to stderr once, at the first step beyond EPOCH_CALL_CHECK_STEPS without a
        set_epoch() call."""
        def say():
            tf.print(tf.strings.format(self._epoch_call_missing("{}"),
                                       [self._epoch_density.read_value()]),
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
                if st.sparse and self._densities is None:
                    self._plans[name] = variable(plan_row(st.numel, self.density, self.config),
                                                 tf.int64)
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

        def body(grad, step_count, at, clip, world, param):
            return self._compress(st, average, grad, step_count, at, clip, world, param)

        fn = self._function("compress", name, average, body)
        out, stats, sent = fn(grad, step.step, step.at, step.clip, step.world, param)
        return ("sparse" if st.sparse else "dense"), out, (st, stats, sent)

    def _plan(self, st, at):
        """The int64 [k, s, ks1, ks2, cap] of ``st`` at this step (:func:`plan_row`): the row
        ``at`` of its table over the warm-up's densities, evaluated now (one row where they
        all give the same plan), or with ``warmup_epochs`` its variable."""
        if at is None:
            return tf.convert_to_tensor(self._plans[st.name])
        table = [plan_row(st.numel, d, self.config) for d in self._densities]
        if all(row == table[0] for row in table):
            return tf.constant(table[0], tf.int64)
        return tf.gather(tf.constant(table, tf.int64), at)

    def _compress(self, st, average, grad, step_count, at, clip, world, param):
        """:meth:`compress_ops`'s ops: (out, the statistics row, the sent entries or None);
        ``step_count``, ``at``, ``clip``, ``world``: :meth:`step_ops`'s. Steps 2-5 of the
        engine contract, and their arithmetic as the eager core's (:meth:`DGCCore._accumulated`,
        :func:`~dgc_horovod.core.accumulate.momentum_correction`)."""
        c, B = self.config, self.B
        n = st.numel
        g = tf.reshape(tf.cast(grad, tf.float32), [-1])
        scale = clip
        if c.clip_norm is not None and c.clip_scope == "tensor":
            scale = clip_factor(tf.cast(tf.norm(g), tf.float64), c.clip_norm, world, average)
        if self.needs_param:
            w = tf.reshape(tf.cast(param, tf.float32), [-1])
            g = (g if scale is None else g * scale) + c.weight_decay * w
            scale = None
        acc = g if scale is None else g * scale     # momentum correction's s·g
        finite = tf.reduce_all(tf.math.is_finite(g))
        if not st.sparse:
            out = tf.cond(finite, lambda: self._velocity(st, acc), lambda: g)
            stats = tf.stack([tf.constant(v, tf.int64)
                              for v in [1, 0, n, 0, 4 * n, 4 * n, 4 * n]]
                             + [tf.cast(tf.logical_not(finite), tf.int64)]
                             + [tf.constant(0, tf.int64)] * 2)
            return out, stats, None
        plan = self._plan(st, at)

        def chosen():
            accumulate(B, st, acc, c)
            return select(st.v, n, plan, sparsify.sample_base(self._seed, st.key, step_count))

        # non-finite: nothing sent, the state untouched
        idx = tf.cond(finite, chosen, lambda: tf.zeros([0], tf.int64))
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
        payload = encode(n, idx, sent, plan[0], flags, c.wire_index, c.wire_values)
        stats = tf.concat([tf.constant([1, 1, n], tf.int64),
                           tf.stack([tf.size(idx, out_type=tf.int64),
                                     4 * tf.size(payload, out_type=tf.int64),
                                     tf.constant(0, tf.int64), tf.constant(4 * n, tf.int64),
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
        label = "bucket." + names[0]

        def body(grads, step_count, at, clip, world, params):
            outs = [self._compress(st, average, g, step_count, at, clip, world, p)
                    for st, g, p in zip(sts, grads, params)]
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
        args = ([g for _, g, _ in entries], step.step, step.at, step.clip, step.world,
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
                    self.B.zero_(t)
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
                    restore_sent(self.B, st.u, st.v, idx, vals,
                                 u_sent if c.momentum_masking else None)
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


def fused_momentum():
    """Whether classic momentum correction runs as ``ResourceApplyMomentum`` (learning rate -1:
    u ← u·m + g; v ← v - (-1)·u), one kernel, without momentum_correction's two reads of u:
    where TensorFlow sees no GPU, as its CPU kernel rounds u·m and the sum each on its own (the
    rule; tests/test_tf_graph.py checks the bits); a GPU kernel may fuse them."""
    return not tf.config.list_logical_devices("GPU")


def accumulate(B, st, g, config):
    """:func:`~dgc_horovod.core.accumulate.momentum_correction` (§3.1, eq. 5-6) on the tensor's
    variables, g already scaled by the clipping factor (:func:`fused_momentum`)."""
    if config.momentum == 0.0 or config.nesterov or not fused_momentum():
        momentum_correction(B, st.u, st.v, g, config.momentum, config.nesterov)
        return
    tf.raw_ops.ResourceApplyMomentum(var=st.v.handle, accum=st.u.handle,
                                     lr=tf.constant(-1.0, tf.float32), grad=g,
                                     momentum=tf.constant(config.momentum, tf.float32),
                                     use_locking=False, use_nesterov=False)


def active_op(process_set):
    """Whether Horovod reduces in this step: its ``_allreduce_cond``'s condition (this rank in
    the process set and more than one rank), as ops under ``HOROVOD_ELASTIC=1``."""
    if under_elastic():
        ps = process_set.process_set_id
        return tf.logical_and(tf.equal(hvd.process_set_included_op(ps), 1),
                              tf.greater(hvd.size_op(ps), 1))
    return tf.constant(bool(process_set.included() and process_set.size() > 1))


def world_size_op(process_set):
    """N for the graph: Horovod's size op under ``HOROVOD_ELASTIC=1`` (a reset changes it without
    a retrace, as Horovod's own reduction reads it), else the process set's size now."""
    if under_elastic():
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
