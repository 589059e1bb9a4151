"""The small tensor interface the DGC core is written against, and its NumPy implementation.

The core (:mod:`accumulate`, :mod:`sparsify`, :mod:`wire`, :mod:`compressor`, the tensor-op
engine of :mod:`engine`) never imports a framework; it calls these methods on flat (1-D) tensors.
`NumpyBackend` runs the reference; the PyTorch and TensorFlow adapters provide their own. Methods
ending in ``_`` update their first argument in place. Integer tensors also take Python's ``&``,
``^``, ``>>``, ``<<``, ``+``, ``-``, ``*`` and comparisons (the sampling hash,
:func:`~dgc_horovod.core.sparsify.mix32`).
"""
import numpy as np


__all__ = ["Backend", "NumpyBackend"]


class Backend:
    """Operations on flat tensors used by the DGC core. Every method must be implemented, except
    the engine hooks at the end (kernel_ptr, kernel_threads, kernel_grad_ptr, kernel_words_ptr,
    empty, device_engine): their defaults opt out of the C and Triton engines.

    Conventions: "float tensor" = float32, "index tensor" = int64 (positions in a flat tensor),
    "words" = int32. Scalars may be Python floats or 0-d tensors of the backend.
    """

    name = "abstract"

    # --- shape and creation
    def numel(self, x): raise NotImplementedError              # -> int
    def ndim(self, x): raise NotImplementedError               # -> int, dimensions
    def zeros(self, n, like): raise NotImplementedError        # float32 zeros (n,)
    def zero_(self, x): raise NotImplementedError              # x[:] = 0 (NaN too); -> x
    def empty_indices(self, like): raise NotImplementedError   # int64 (0,)
    def float32_flat(self, x): raise NotImplementedError       # float32 1-D copy of x
    def float32_view(self, x): raise NotImplementedError       # float32 1-D, read only (no copy
                                                               # when x already is float32)
    def scale_add_(self, x, a, y, b): raise NotImplementedError  # x = a*x + b*y
    def is_floating(self, x): raise NotImplementedError        # -> bool
    def all_finite(self, x): raise NotImplementedError         # -> bool
    # --- arithmetic
    def norm(self, x): raise NotImplementedError               # L2 norm, scalar
    def mul_(self, x, a): raise NotImplementedError            # x *= a
    def add_(self, x, y, alpha=1.0): raise NotImplementedError  # x += alpha * y
    def abs(self, x): raise NotImplementedError                # may reuse a scratch buffer:
                                                               # valid until the next abs()
    # --- selection
    def topk_indices(self, x, k): raise NotImplementedError    # indices of the k largest of x
    def kth_largest(self, x, k): raise NotImplementedError     # the k-th largest value, scalar
    def indices_where_ge(self, x, t): raise NotImplementedError  # positions where x >= t
    def drop_zeros(self, idx, mag): raise NotImplementedError  # idx where mag > 0
    def take(self, x, idx): raise NotImplementedError          # x[idx]
    def scatter_(self, x, idx, vals): raise NotImplementedError  # x[idx] = vals
    def fill_at_(self, x, idx, value): raise NotImplementedError  # x[idx] = value
    def scale_at_(self, x, idx, a):                            # x[idx] = x[idx] * a, each
        vals = self.take(x, idx)                               # position once even if idx
        self.mul_(vals, a)                                     # repeats it (gathered before
        self.scatter_(x, idx, vals)                            # any write)
    def index_add_(self, x, idx, vals): raise NotImplementedError  # x[idx] += vals (idx unique)
    # --- wire
    def int32_tensor(self, values, like): raise NotImplementedError
    def to_int32(self, idx): raise NotImplementedError
    def to_int64(self, idx): raise NotImplementedError
    def float32_bits(self, x): raise NotImplementedError       # float32 -> int32 bit patterns
    def bits_float32(self, w): raise NotImplementedError       # int32 bit patterns -> float32
    def cat(self, xs): raise NotImplementedError
    def slice(self, x, a, b): raise NotImplementedError
    def to_list(self, x): raise NotImplementedError            # small tensor -> list of ints
    def min_max(self, x): raise NotImplementedError            # -> (int, int)
    # --- the wire format (index deltas, fp16); functional: they return new tensors
    def sort(self, idx): raise NotImplementedError             # ascending
    def int64_tensor(self, values, like): raise NotImplementedError
    def int64_zeros(self, n, like): raise NotImplementedError
    def cumsum(self, x): raise NotImplementedError             # int64 running sum
    def put(self, x, pos, vals): raise NotImplementedError     # copy of x with x[pos] = vals
    def where(self, cond, a, b): raise NotImplementedError     # b may be a Python scalar
    def mask(self, x, cond): raise NotImplementedError         # x[cond]
    def count_true(self, cond): raise NotImplementedError      # -> int
    def pack16(self, tokens): raise NotImplementedError        # ints in 0..65535 -> int32 words
    def unpack16(self, words, n): raise NotImplementedError    # -> n int64 tokens
    def pack_fp16(self, x): raise NotImplementedError          # float32 -> float16 pairs in words
    def unpack_fp16(self, words, n): raise NotImplementedError  # -> n float32
    def to_fp16_and_back(self, x): raise NotImplementedError   # float32 rounded through float16
    # --- checkpoints (DGCCore.state_dict / load_state_dict); state is restored with float32_flat
    def state_copy(self, x): raise NotImplementedError         # copy of a state tensor, detached
                                                               # from later in-place updates
    # --- engines (dgc_horovod.core.engine). Optional: these defaults opt out, and the core then
    #     runs the tensor-op engine on the methods above.
    def device_name(self, x): return "a device"          # where x lives, for messages
    def device_engine(self, like, required=False):       # the engine for tensors like ``like``
        if required:                                     # outside host memory (the Triton
            raise ValueError(f"DGC(engine='triton'): the {self.name} backend has no Triton "
                             "engine; use engine='auto'")  # kernels), None: tensor ops
        return None
    def kernel_ptr(self, x): return None                 # address (int) of x's first element if
                                                         # the C kernels may read and write it
                                                         # (host memory, contiguous), else None
    def empty(self, n, dtype, like): raise NotImplementedError  # uninitialised (n,) tensor of
                                                         # dtype "float32", "float64", "int64" or
                                                         # "int32"
    def kernel_threads(self): return 1                   # threads the kernels may use (as many
                                                         # as the framework's own CPU ops)
    def kernel_grad_ptr(self, x): return None            # address of x's data when x itself is
                                                         # a float32 contiguous host tensor (no
                                                         # view or copy made), else None
    def kernel_words_ptr(self, x): return None           # the same for int32 words (a received
                                                         # payload: the C engine's decode)
    def split(self, x, sizes):                           # consecutive views of x of these sizes
        out, a = [], 0                                   # (sum(sizes) == numel(x))
        for n in sizes:
            out.append(self.slice(x, a, a + n))
            a += n
        return out
    # --- a bucket's flat state (dgc_horovod.core.engine.FlatState)
    def flat_cat(self, xs, block=1):                     # a new float32 1-D concatenation of
        zeros = self.zeros(block - 1, like=xs[0]) if block > 1 else None  # the tensors xs (any
        parts = []                                       # shape, floating), each followed by
        for x in xs:                                     # zeros up to a multiple of block
            parts.append(self.float32_view(x))
            if -self.numel(x) % block:
                parts.append(self.slice(zeros, 0, -self.numel(x) % block))
        return self.cat(parts)
    def flat_views(self, flat, offsets, sizes):          # views of flat (float32 state): sizes[j]
        return [self.slice(flat, a, a + n)               # elements from offsets[j], that alias
                for a, n in zip(offsets, sizes)]         # it (in-place updates of one show in
                                                         # the other), or None when the backend
                                                         # has no such views
    def arange(self, n, like): raise NotImplementedError  # int64 0 .. n-1


class NumpyBackend(Backend):
    """Reference backend on NumPy arrays (float32 state, int64 indices)."""

    name = "numpy"

    def numel(self, x): return int(x.size)
    def ndim(self, x): return int(np.ndim(x))
    def zeros(self, n, like=None): return np.zeros(n, dtype=np.float32)

    def zero_(self, x):
        x[...] = 0
        return x

    def empty_indices(self, like=None): return np.zeros(0, dtype=np.int64)
    def float32_flat(self, x): return np.asarray(x, dtype=np.float32).reshape(-1).copy()
    def float32_view(self, x): return np.asarray(x, dtype=np.float32).reshape(-1)

    def scale_add_(self, x, a, y, b):
        x *= np.float32(a)
        x += y if b == 1.0 else np.float32(b) * y
    def is_floating(self, x): return np.issubdtype(np.asarray(x).dtype, np.floating)
    def all_finite(self, x): return bool(np.isfinite(x).all())
    def norm(self, x): return np.float32(np.sqrt(np.dot(x, x, out=None)))

    def mul_(self, x, a):
        x *= np.float32(a)

    def add_(self, x, y, alpha=1.0):
        if alpha == 1.0:
            x += y
        else:
            x += np.float32(alpha) * y

    def abs(self, x): return np.abs(x)

    def topk_indices(self, x, k):
        if k >= x.size:
            return np.arange(x.size, dtype=np.int64)
        return np.argpartition(-x, k - 1)[:k].astype(np.int64)

    def kth_largest(self, x, k): return np.partition(x, x.size - k)[x.size - k]
    def indices_where_ge(self, x, t): return np.flatnonzero(x >= t).astype(np.int64)
    def drop_zeros(self, idx, mag): return idx[mag > 0]
    def take(self, x, idx): return x[idx]

    def scatter_(self, x, idx, vals):
        x[idx] = vals

    def fill_at_(self, x, idx, value):
        x[idx] = value

    def index_add_(self, x, idx, vals):
        np.add.at(x, idx, vals)

    def int32_tensor(self, values, like=None): return np.asarray(values, dtype=np.int64).astype(np.int32)
    def to_int32(self, idx): return idx.astype(np.int32)
    def to_int64(self, idx): return idx.astype(np.int64)
    def float32_bits(self, x): return np.ascontiguousarray(x, dtype=np.float32).view(np.int32)
    def bits_float32(self, w): return np.ascontiguousarray(w, dtype=np.int32).view(np.float32)
    def cat(self, xs): return np.concatenate(xs)
    def slice(self, x, a, b): return x[a:b]
    def to_list(self, x): return [int(i) for i in x]
    def min_max(self, x): return int(x.min()), int(x.max())

    def sort(self, idx): return np.sort(idx)
    def int64_tensor(self, values, like=None): return np.asarray(values, dtype=np.int64)
    def int64_zeros(self, n, like=None): return np.zeros(n, dtype=np.int64)
    def cumsum(self, x): return np.cumsum(x, dtype=np.int64)

    def put(self, x, pos, vals):
        out = x.copy()
        out[pos] = vals
        return out

    def where(self, cond, a, b): return np.where(cond, a, b)
    def mask(self, x, cond): return x[cond]
    def count_true(self, cond): return int(np.count_nonzero(cond))

    def pack16(self, tokens):
        t = np.zeros(tokens.size + tokens.size % 2, dtype=np.uint16)
        t[:tokens.size] = tokens
        return t.view(np.int32)

    def unpack16(self, words, n):
        return np.ascontiguousarray(words, dtype=np.int32).view(np.uint16)[:n].astype(np.int64)

    # (a value beyond float16's range becomes ±inf, as in the other frameworks; the DGC core
    # counts and reports it, so NumPy's own overflow warning is silenced)
    def pack_fp16(self, x):
        h = np.zeros(x.size + x.size % 2, dtype=np.float16)
        with np.errstate(over="ignore"):
            h[:x.size] = x
        return h.view(np.int32)

    def unpack_fp16(self, words, n):
        return np.ascontiguousarray(words, dtype=np.int32).view(np.float16)[:n].astype(np.float32)

    def to_fp16_and_back(self, x):
        with np.errstate(over="ignore"):
            return x.astype(np.float16).astype(np.float32)

    def state_copy(self, x): return np.array(x, dtype=np.float32, copy=True)
    def device_name(self, x): return "the host"


    _DTYPES = {"float32": np.float32, "int64": np.int64, "int32": np.int32,
               "float64": np.float64}

    def kernel_grad_ptr(self, x):
        if isinstance(x, np.ndarray) and x.dtype == np.float32 and x.flags.c_contiguous:
            return x.ctypes.data
        return None

    def kernel_words_ptr(self, x):
        if isinstance(x, np.ndarray) and x.dtype == np.int32 and x.flags.c_contiguous:
            return x.ctypes.data
        return None

    def kernel_ptr(self, x):
        if (isinstance(x, np.ndarray) and x.flags.c_contiguous
                and x.dtype in (np.float32, np.float64, np.int64, np.int32)):
            return x.ctypes.data
        return None

    def empty(self, n, dtype, like=None): return np.empty(n, dtype=self._DTYPES[dtype])

    def arange(self, n, like=None): return np.arange(n, dtype=np.int64)


