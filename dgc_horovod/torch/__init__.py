"""DGC for PyTorch: a Horovod ``Compressor`` for ``horovod.torch.DistributedOptimizer``.

Usage (the only change to a Horovod script)::

    import horovod.torch as hvd
    from dgc_horovod.torch import DGC
    dgc = DGC(compress_ratio=0.001, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * hvd.size())   # no momentum here: DGC has it
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=dgc)
    for epoch in ...:
        dgc.set_epoch(epoch)          # drives the sparsity warm-up
        ...

How it rides on stock Horovod (0.28.x, unmodified, nothing patched):

* Horovod calls ``compress(p.grad)`` from ``DistributedOptimizer._allreduce_grad_async(p)`` (or
  ``_grouped_allreduce_grad_async(ps)``) when a gradient is ready, then allreduces the result
  under the parameter's name and later calls ``decompress(output, ctx)`` in ``synchronize()``.
* **Which parameter is this?** ``compress`` receives only the gradient. DGC looks one to three
  frames up the call stack for the calling Horovod optimizer (``self``) and the parameter being
  reduced (its local ``p``), and verifies ``p.grad is tensor`` before using it; if the parameter in
  that frame does not own the tensor, it searches the optimizer's parameters for the one whose
  ``.grad`` is the tensor. State (velocity u, residual v) is keyed by the parameter's name from
  ``named_parameters`` — the same name Horovod uses for its collectives, so it is identical on
  every rank. This does not depend on the gradient object: it works with
  ``zero_grad(set_to_none=True)`` (a new ``.grad`` every step) and ``False``, with
  ``backward_passes_per_step > 1`` (compress runs once, on the accumulated gradient), and for
  parameters without a gradient in a step (Horovod hands DGC zeros; DGC then only decays the
  velocity). Called from anywhere else, DGC raises a RuntimeError saying how to use it.
* **Exchange.** For a sparsified tensor, ``compress`` accumulates, selects, encodes, starts
  ``hvd.allgather_async`` of the payload (named ``dgc.<parameter name>``, overlapping with the
  rest of backward), and returns a 1-element zero placeholder: Horovod's own allreduce then
  carries 4 bytes for this tensor. ``decompress`` waits for the allgather, sums every rank's
  entries in rank order (bit-identical on every rank) and divides by the world size for
  ``op=hvd.Average``. Tensors below ``min_sparse_numel`` go through Horovod's dense allreduce as
  their momentum-corrected velocity.
* **One process.** With ``hvd.size() == 1`` Horovod's optimizer never calls the compressor, so DGC
  does nothing at all; DGC warns when it is created after ``hvd.init()`` in a 1-process job.
* **Momentum.** DGC applies momentum itself (momentum correction); creating the wrapped optimizer
  with momentum > 0 as well would apply it twice, so DGC raises a ValueError at the first step
  when both are > 0. Weight decay may stay in the wrapped optimizer (it is then added after the
  exchange, outside momentum) or move into ``DGC(weight_decay=...)`` (added before momentum
  correction, as in the paper's implementation).
"""
import sys
import warnings

import horovod.torch as hvd
import torch
from horovod.torch.compression import Compressor

from dgc_horovod.core import DGCConfig, DGCCore
from dgc_horovod.torch.backend import TorchBackend

__all__ = ["DGC"]

_HINT = ("pass it to horovod.torch.DistributedOptimizer(..., compression=DGC(...)); "
         "DGC keeps per-parameter state and must know which parameter a gradient belongs to")


def _find_parameter(tensor, compressor):
    """(optimizer, parameter, name) of the Horovod call that is compressing ``tensor``."""
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


class _Pending:
    """ctx of a sparsified tensor between compress and decompress."""

    __slots__ = ("handle", "core_ctx", "shape", "dtype", "world_size", "average")

    def __init__(self, handle, core_ctx, shape, dtype, world_size, average):
        self.handle, self.core_ctx, self.shape, self.dtype = handle, core_ctx, shape, dtype
        self.world_size, self.average = world_size, average


class DGC(Compressor):
    """Deep Gradient Compression as a Horovod compressor (Lin et al., ICLR 2018).

    Keyword arguments are those of :class:`dgc_horovod.core.DGCConfig` (compress_ratio=0.001,
    momentum=0.9, nesterov=False, momentum_masking=True, clip_norm=None, weight_decay=0.0,
    sample_ratio=0.01, exact_topk=False, min_sparse_numel=1, warmup_epochs=4,
    warmup_initial_density=0.25, warmup_per_step=False, seed=0), or pass ``config=DGCConfig(...)``.

    Use one DGC object per DistributedOptimizer, created identically on every rank.

    Attributes:
        config (DGCConfig): the settings. stats (CompressionStats): the most recent step's
        counters for this rank (elements selected, wire bytes, dense bytes, ratio). total_stats:
        cumulative counters. density (float): the density in force (warm-up).

    Raises (from compress, i.e. from ``loss.backward()``):
        TypeError: a non-floating gradient. ValueError: momentum set both here and in the wrapped
        optimizer; a parameter whose size changed. RuntimeError: used outside
        ``hvd.DistributedOptimizer``, or with ``op=hvd.Adasum``.
    """

    def __init__(self, config=None, **kwargs):
        if config is not None and kwargs:
            raise TypeError("pass either config=DGCConfig(...) or keyword arguments, not both")
        self.config = config if config is not None else DGCConfig(**kwargs)
        self._core = DGCCore(self.config, TorchBackend())
        self._checked = set()
        if hvd.is_initialized() and hvd.size() == 1:
            warnings.warn("one Horovod process: hvd.DistributedOptimizer registers no gradient "
                          "hooks and never calls the compressor, so DGC (and its momentum "
                          "correction) does nothing; launch 2+ processes, or train with the "
                          "optimizer's own momentum on one")

    # warm-up and statistics ------------------------------------------------------------
    def set_epoch(self, epoch):
        """Set the warm-up position (epochs completed, float); call on every rank alike."""
        self._core.set_epoch(epoch)

    def set_step(self, step, steps_per_epoch):
        """Set the warm-up position from a step count: epoch = step / steps_per_epoch."""
        self._core.set_step(step, steps_per_epoch)

    @property
    def density(self):
        return self._core.density

    @property
    def stats(self):
        return self._core.step_stats

    @property
    def total_stats(self):
        return self._core.total_stats

    @property
    def states(self):
        """Per-parameter :class:`~dgc_horovod.core.compressor.TensorState`, keyed by name."""
        return self._core.states

    # Horovod Compressor API ---------------------------------------------------------------
    def compress(self, tensor):
        """Accumulate ``tensor`` (a parameter's gradient) and start its exchange.

        Returns (tensor for Horovod's allreduce, ctx): a 1-element zero placeholder for a
        sparsified tensor (its payload is already on its way by allgather), or the dense
        momentum-corrected velocity for a small tensor.
        """
        opt, p, name = _find_parameter(tensor, self)
        if name not in self._checked:
            self._check(opt, p, name)
        process_set = opt.process_set
        world = process_set.size()
        kind, out, core_ctx = self._core.compress(name, tensor, world, param=p.detach())
        if kind == "dense":
            return out.view(tensor.shape).to(tensor.dtype), (tensor.shape, tensor.dtype)
        handle = hvd.allgather_async(out, name="dgc." + name, process_set=process_set)
        ctx = _Pending(handle, core_ctx, tensor.shape, tensor.dtype, world, opt.op == hvd.Average)
        return tensor.new_zeros(1), ctx

    def decompress(self, tensor, ctx):
        """Return the averaged (or summed) gradient for Horovod to set as ``p.grad``."""
        if ctx is None:                       # Horovod's sparse (two-allgather) path
            return tensor
        if not isinstance(ctx, _Pending):     # small tensor: Horovod's allreduce already reduced
            shape, dtype = ctx
            return tensor.view(shape).to(dtype)
        gathered = hvd.synchronize(ctx.handle)
        dense = self._core.decompress(gathered, ctx.core_ctx, ctx.world_size, ctx.average)
        return dense.view(ctx.shape).to(ctx.dtype)

    def _check(self, opt, p, name):
        if opt.op not in (hvd.Average, hvd.Sum):
            raise RuntimeError("DGC supports op=hvd.Average and op=hvd.Sum, not Adasum")
        for group in opt.param_groups:
            if any(q is p for q in group["params"]):
                m = group.get("momentum", 0.0) or 0.0
                if m > 0 and self.config.momentum > 0:
                    raise ValueError(
                        f"momentum would be applied twice to {name!r}: DGC(momentum="
                        f"{self.config.momentum}) applies momentum correction itself, and the "
                        f"wrapped optimizer {type(opt).__mro__[1].__name__} has momentum={m}. "
                        "Create the optimizer with momentum=0 (and nesterov=False), or use "
                        "DGC(momentum=0) for plain error feedback.")
                break
        self._checked.add(name)

    def __repr__(self):
        return f"DGC({self.config!r})"
