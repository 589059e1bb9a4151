"""The per-tensor records of :class:`~dgc_horovod.core.compressor.DGCCore`, in the order a
gradient meets them: :class:`TensorState`, what a worker keeps of one gradient tensor between
steps (velocity u, residual v, the separate weight decay's buffer; made at its first compress),
and :class:`SparseContext`, what a compress of a sparsified tensor hands its decompress.
"""

from dgc_horovod.core.sparsify import tensor_key

__all__ = ["TensorState", "SparseContext"]


class TensorState:
    """DGC state of one gradient tensor on one worker.

    Attributes: name (str), numel (int), ndim (int: the gradient's dimensions), sparse (bool:
    selected by top-k, else dense allreduce; :func:`~dgc_horovod.core.sparsify.is_sparse`),
    u (flat float32 velocity, or None when momentum is 0), v (flat float32 accumulated velocity,
    the residual; None for dense tensors), wd (flat float32 momentum buffer of the weight decay
    term with ``weight_decay_mode="separate"``, else None).
    """

    __slots__ = ("name", "numel", "ndim", "sparse", "u", "v", "wd", "key")

    def __init__(self, name, numel, sparse, u, v, ndim=1, wd=None):
        self.name, self.numel, self.sparse, self.u, self.v = name, numel, sparse, u, v
        self.ndim, self.wd = ndim, wd
        self.key = tensor_key(name)     # the sampling hash's key of the tensor


class SparseContext:
    """What decompress needs of a compress call: the tensor, and what to restore on a discard."""

    __slots__ = ("name", "numel", "indices", "values", "u_sent")

    def __init__(self, name, numel, indices, values, u_sent):
        self.name, self.numel = name, numel
        self.indices, self.values, self.u_sent = indices, values, u_sent
