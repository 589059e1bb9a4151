"""`TFBackend`: the DGC core's tensor interface on eager TensorFlow tensors.

The core runs eagerly (inside ``tf.py_function`` when Horovod traces its reduction); every tensor
it mutates in place is a ``tf.Variable`` created eagerly, i.e. outside any trace (:func:`variable`).
"""
import tensorflow as tf
from tensorflow.python.ops.resource_variable_ops import ResourceVariable

from dgc_horovod.core.backend import Backend

__all__ = ["TFBackend", "variable"]


def variable(value, dtype=None):
    """A non-trainable variable holding ``value``, created eagerly (``tf.init_scope``) even when
    called while a ``tf.function`` traces: the ``ResourceVariable`` constructor, since
    ``tf.Variable`` inside a trace goes through ``tf.function``'s creator, which refuses a
    variable made at any trace but the first (a tensor Horovod reduces only from a later step
    on, or a retrace)."""
    with tf.init_scope():
        return ResourceVariable(value, dtype=dtype, trainable=False)


def _col(idx):
    return tf.reshape(tf.cast(idx, tf.int64), [-1, 1])


def _pairs_as_words(t):
    """A 16-bit tensor as int32 words, two elements a word (a zero appended to an odd count)."""
    if int(tf.size(t)) % 2:
        t = tf.concat([t, tf.zeros([1], t.dtype)], 0)
    return tf.bitcast(tf.reshape(t, [-1, 2]), tf.int32)


def _words_as(words, dtype, n):
    """The first n 16-bit elements of ``dtype`` held in int32 words (:func:`_pairs_as_words`)."""
    return tf.reshape(tf.bitcast(words, dtype), [-1])[:n]


class TFBackend(Backend):
    """TensorFlow implementation of :class:`dgc_horovod.core.backend.Backend` (eager, flat)."""

    name = "tensorflow"

    def numel(self, x): return int(tf.size(x))
    def ndim(self, x): return len(x.shape)

    def zeros(self, n, like=None):
        return variable(tf.zeros([n], tf.float32))

    def zero_(self, x):
        x.assign(tf.zeros_like(x))
        return x

    def empty_indices(self, like=None): return tf.zeros([0], tf.int64)

    def float32_flat(self, x):
        return variable(tf.reshape(tf.cast(x, tf.float32), [-1]))

    def float32_view(self, x): return tf.reshape(tf.cast(x, tf.float32), [-1])
    def scale_add_(self, x, a, y, b):
        y = tf.convert_to_tensor(y)
        x.assign(a * x + (y if b == 1.0 else b * y))       # 1.0 · y is y: one pass less

    def is_floating(self, x): return bool(getattr(x, "dtype", None) is not None and x.dtype.is_floating)
    def all_finite(self, x): return bool(tf.reduce_all(tf.math.is_finite(x)))
    def norm(self, x): return tf.norm(x)
    def mul_(self, x, a): x.assign(x * a)

    def add_(self, x, y, alpha=1.0):
        x.assign_add(y if alpha == 1.0 else alpha * tf.convert_to_tensor(y))

    def abs(self, x): return tf.abs(x)

    def topk_indices(self, x, k):
        return tf.cast(tf.math.top_k(tf.convert_to_tensor(x), k, sorted=False).indices, tf.int64)

    def kth_largest(self, x, k): return tf.math.top_k(x, k, sorted=True).values[k - 1]
    def indices_where_ge(self, x, t): return tf.reshape(tf.where(x >= t), [-1])
    def drop_zeros(self, idx, mag): return tf.boolean_mask(idx, mag > 0)
    def take(self, x, idx): return tf.gather(x, idx)
    def scatter_(self, x, idx, vals): x.scatter_nd_update(_col(idx), vals)
    def scale_at_(self, x, idx, a): x.scatter_nd_update(_col(idx), tf.gather(x, idx) * a)

    def fill_at_(self, x, idx, value):
        x.scatter_nd_update(_col(idx), tf.fill(tf.shape(idx), tf.constant(value, tf.float32)))

    def index_add_(self, x, idx, vals): x.scatter_nd_add(_col(idx), vals)
    def int32_tensor(self, values, like=None): return tf.constant(values, tf.int32)
    def to_int32(self, idx): return tf.cast(idx, tf.int32)
    def to_int64(self, idx): return tf.cast(idx, tf.int64)
    def float32_bits(self, x): return tf.bitcast(tf.convert_to_tensor(x, tf.float32), tf.int32)
    def bits_float32(self, w): return tf.bitcast(w, tf.float32)
    def cat(self, xs): return tf.concat([tf.convert_to_tensor(x) for x in xs], 0)
    def slice(self, x, a, b): return x[a:b]
    def to_list(self, x): return [int(i) for i in x.numpy()]
    def min_max(self, x): return int(tf.reduce_min(x)), int(tf.reduce_max(x))

    def sort(self, idx): return tf.sort(idx)
    def int64_tensor(self, values, like=None): return tf.constant(values, tf.int64)
    def int64_zeros(self, n, like=None): return tf.zeros([n], tf.int64)
    def empty(self, n, dtype, like=None):       # (writable, as zeros: TF has no uninitialised)
        return variable(tf.zeros([n], getattr(tf, dtype)))
    def cumsum(self, x): return tf.cumsum(x)
    def put(self, x, pos, vals): return tf.tensor_scatter_nd_update(x, _col(pos), vals)

    def where(self, cond, a, b):
        return tf.where(cond, a, tf.cast(b, a.dtype) if not tf.is_tensor(b) else b)

    def mask(self, x, cond): return tf.boolean_mask(x, cond)
    def count_true(self, cond): return int(tf.math.count_nonzero(cond))

    def pack16(self, tokens): return _pairs_as_words(tf.cast(tokens, tf.uint16))
    def unpack16(self, words, n): return tf.cast(_words_as(words, tf.uint16, n), tf.int64)
    def pack_fp16(self, x): return _pairs_as_words(tf.cast(x, tf.float16))
    def unpack_fp16(self, words, n): return tf.cast(_words_as(words, tf.float16, n), tf.float32)
    def to_fp16_and_back(self, x): return tf.cast(tf.cast(x, tf.float16), tf.float32)

    def state_copy(self, x): return tf.identity(tf.convert_to_tensor(x))

    # the state is in tf.Variables, which have no views of a flat buffer: the engines that work
    # on a bucket's flat state (C, Triton) never run here
    def flat_views(self, flat, offsets, sizes): return None

    def arange(self, n, like=None): return tf.range(n, dtype=tf.int64)
