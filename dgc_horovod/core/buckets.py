"""The bucket plan: which tensors share one payload exchange (framework-free).

The parameters, in reverse registration order (roughly the order backward produces their
gradients), are cut into consecutive groups of about ``bucket_numel`` dense elements. The plan
depends only on the model and the config, so it is the same on every rank; the PyTorch adapter
(:mod:`dgc_horovod.torch.exchange`) and the simulated cluster (:mod:`dgc_horovod.simulate`) both
use it, so they compress the same buckets in the same order.
"""
from dgc_horovod.core.sparsify import is_sparse

__all__ = ["cut", "plan_buckets"]


def cut(sizes, bucket_numel):
    """The bucket rule: consecutive groups of the items of ``sizes`` (elements each, in plan
    order), each closed once it holds ``bucket_numel`` elements or more, the last with what is
    left; 0 makes every item its own group (a tensor is a bucket of one). Returns lists of item
    indices."""
    groups, group, size = [], [], 0
    for i, numel in enumerate(sizes):
        group.append(i)
        size += numel
        if size >= bucket_numel or i == len(sizes) - 1:
            groups.append(group)
            group, size = [], 0
    return groups


def plan_buckets(params, bucket_numel, config):
    """Cut ``params`` into buckets (:func:`cut` of their element counts).

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
    return [([params[i][0] for i in group], [is_sparse(params[i][1], params[i][2], config)
                                             for i in group])
            for group in cut([numel for _, numel, _ in params], bucket_numel)]
