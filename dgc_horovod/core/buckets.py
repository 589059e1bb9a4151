"""The bucket plan: which tensors share one payload exchange (framework-free).

The parameters, in reverse registration order (roughly the order backward produces their
gradients), are cut into consecutive groups of about ``bucket_numel`` dense elements. The plan
depends only on the model and the config, so it is the same on every rank; the PyTorch adapter
(:mod:`dgc_horovod.torch.exchange`) and the simulated cluster (:mod:`dgc_horovod.simulate`) both
use it, so they compress the same buckets in the same order.
"""
from dgc_horovod.core.sparsify import is_sparse

__all__ = ["plan_buckets"]


def plan_buckets(params, bucket_numel, config):
    """Cut ``params`` into buckets.

    Args:
        params: sequence of (name, numel, ndim), in plan order (reverse registration order).
        bucket_numel (int): dense elements per bucket; 0 makes every tensor its own bucket.
        config (DGCConfig): for the sparse/dense rule (:func:`~dgc_horovod.core.sparsify.is_sparse`).
    Returns:
        list of (members, sparse) per bucket, in order: members the names of every parameter of
        the bucket (the frame's member indices refer to them), sparse the flags saying which of
        them are sparsified (only those send a payload; the others go through the dense
        allreduce and never join the bucket).
    """
    buckets, members, flags, size = [], [], [], 0
    for i, (name, numel, ndim) in enumerate(params):
        members.append(name)
        flags.append(is_sparse(numel, ndim, config))
        size += numel
        if size >= bucket_numel or i == len(params) - 1:
            buckets.append((members, flags))
            members, flags, size = [], [], 0
    return buckets
