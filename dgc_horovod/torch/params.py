"""Which parameter is this? How :class:`dgc_horovod.torch.DGC` finds the parameter a gradient
belongs to, and the optimizer settings that apply to it.

Horovod's ``compress`` receives only the gradient. Horovod calls it from
``DistributedOptimizer._allreduce_grad_async(p)`` (or ``_grouped_allreduce_grad_async(ps)``)
when a gradient is ready, so :func:`find_parameter` looks one to three frames up the call stack
for the calling Horovod optimizer (``self``) and the parameter being reduced (its local ``p``),
and verifies ``p.grad is tensor`` before using it; if the parameter in that frame does not own
the tensor, it searches the optimizer's parameters for the one whose ``.grad`` is the tensor.
State (velocity u, residual v) is keyed by the parameter's name from ``named_parameters``: the
same name Horovod uses for its collectives, so it is identical on every rank. This does not
depend on the gradient object: it works with ``zero_grad(set_to_none=True)`` (a new ``.grad``
every step) and ``False``, with ``backward_passes_per_step > 1`` (compress runs once, on the
accumulated gradient), and for parameters without a gradient in a step (Horovod hands DGC zeros;
DGC then only decays the velocity). Called from anywhere else, DGC raises a RuntimeError saying
how to use it.
"""
import sys

import horovod.torch as hvd
import torch

__all__ = ["find_parameter", "param_group"]

_HINT = ("pass it to horovod.torch.DistributedOptimizer(..., compression=DGC(...)); "
         "DGC keeps per-parameter state and must know which parameter a gradient belongs to")


def find_parameter(tensor, compressor):
    """(optimizer, parameter, name) of the Horovod call that is compressing ``tensor``; call it
    from ``compressor.compress`` itself (it reads the caller's caller's frames)."""
    frame = sys._getframe(2)
    candidates = []
    for _ in range(4):
        if frame is None:
            break
        local = frame.f_locals
        if isinstance(local.get("p"), torch.Tensor):
            candidates.append(local["p"])
        opt = local.get("self")
        if isinstance(opt, torch.optim.Optimizer) and hasattr(opt, "_parameter_names"):
            if getattr(opt, "_compression", None) is not compressor:
                raise RuntimeError("this DGC object is not the compression of the Horovod "
                                   "optimizer calling it; " + _HINT)
            if getattr(opt, "op", None) not in (hvd.Average, hvd.Sum):
                # (Horovod's Adasum optimizer has no op attribute and compresses parameters)
                raise RuntimeError("DGC supports hvd.DistributedOptimizer with op=hvd.Average or "
                                   "op=hvd.Sum, not op=hvd.Adasum")
            for p in candidates:
                if _owns(p, tensor):
                    return opt, p, opt._parameter_names[p]
            for p in opt._parameter_names:      # fallback: search (e.g. a changed call site)
                if _owns(p, tensor):
                    return opt, p, opt._parameter_names[p]
            raise RuntimeError("DGC could not find the parameter whose gradient it was given "
                               f"(shape {tuple(tensor.shape)}) among the optimizer's parameters")
        frame = frame.f_back
    raise RuntimeError("dgc_horovod.torch.DGC was called outside horovod.torch."
                       "DistributedOptimizer; " + _HINT)


def _owns(p, tensor):
    g = p.grad
    return g is tensor or (g is not None and g.is_sparse and g.shape == tensor.shape)


def param_group(opt, p):
    """The parameter group of ``opt`` that holds ``p`` (its momentum, betas, ...), or None."""
    for group in opt.param_groups:
        if any(q is p for q in group["params"]):
            return group
    return None
