"""DGC for PyTorch: a Horovod ``Compressor`` for ``horovod.torch.DistributedOptimizer``.

Usage (the only change to a Horovod script)::

    import horovod.torch as hvd
    from dgc_horovod.torch import DGC
    dgc = DGC(compress_ratio=0.004, momentum=0.9)       # warm-up: its own step count
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * hvd.size())   # no momentum here: DGC has it
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=dgc)

How it rides on stock Horovod (0.28.x, unmodified, nothing patched):

* Horovod calls ``compress(p.grad)`` from ``DistributedOptimizer._allreduce_grad_async(p)`` (or
  ``_grouped_allreduce_grad_async(ps)``) when a gradient is ready, then allreduces the result
  under the parameter's name and later calls ``decompress(output, ctx)`` in ``synchronize()``.
* **Which parameter is this?** ``compress`` receives only the gradient; DGC finds the parameter
  on the call stack (:mod:`dgc_horovod.torch.params`) and keys its state (velocity u, residual v)
  by the parameter's name from ``named_parameters``, identical on every rank. Called from
  anywhere else, DGC raises a RuntimeError saying how to use it.
* **Exchange.** A sparsified tensor travels by :mod:`dgc_horovod.torch.exchange`, and
  ``compress`` returns a 1-element zero placeholder for it: Horovod's own allreduce then carries
  4 bytes. With buckets (the default), ``compress`` only checks the gradient and records it in
  its bucket of parameters; when the bucket's last sparsified member arrives, the bucket is
  accumulated, selected and encoded in one ``DGCCore.compress_many`` call and its one
  ``hvd.allgather_async`` starts, overlapping with the rest of backward (a bucket still
  incomplete when Horovod synchronizes is compressed and sent then). With ``bucket_numel=0``,
  ``compress`` compresses the tensor at once and starts its own allgather, named
  ``dgc.<parameter name>``. ``decompress`` waits for the allgather, sums every rank's
  entries in rank order (bit-identical on every rank) and divides by the world size for
  ``op=hvd.Average``. Tensors that are not sparsified (1-D by default) are compressed at once
  and go through Horovod's dense allreduce as their momentum-corrected velocity.
* **Global clipping** (``clip_norm`` with the default ``clip_scope="global"``): the rank's
  clipping factor needs the norm over all of its gradients of the step, so every gradient,
  dense ones included, is recorded until the step's last one arrives; then the factor is
  computed, the buckets are compressed in plan order and allgathered, and the dense tensors are
  allreduced by DGC itself (see :mod:`dgc_horovod.torch.exchange`). The cost: the exchange no
  longer overlaps with backward. ``clip_scope="tensor"`` keeps the overlap.
* **Horovod Elastic.** Pass the DGC object to ``hvd.elastic.TorchState(model, optimizer,
  dgc=dgc, ...)``: :mod:`dgc_horovod.torch.elastic` registers a state handler with Horovod, so
  ``state.commit()`` saves the compressor state with the model, a HorovodInternalError restores
  the committed one, and ``sync`` gives every rank rank 0's warm-up epoch and sampling generator.
  At every reset (Horovod re-initialized: a worker left or joined) every rank drops its velocities
  and residuals, bucket plans and first-step checks (see :meth:`DGC.on_reset`).
* **One process.** With ``hvd.size() == 1`` Horovod's optimizer never calls the compressor, so DGC
  does nothing at all; DGC warns when it is created after ``hvd.init()`` in a 1-process job.
* **Momentum.** DGC applies momentum itself (momentum correction); creating the wrapped optimizer
  with momentum > 0 as well would apply it twice, so DGC raises a ValueError at the first step
  when both are > 0. Weight decay belongs in ``DGC(weight_decay=...)`` (and 0 in the wrapped
  optimizer): by default (``weight_decay_mode="separate"``, the authors' reference code) it is
  added densely after the exchange through its own momentum buffer, as dense momentum SGD
  would; in the wrapped optimizer it would be added after the exchange *without* momentum.
"""
import warnings
import weakref

import horovod.torch as hvd
import torch
from horovod.torch.compression import Compressor

from dgc_horovod.adapter import DGCAdapter, compression_namespace
from dgc_horovod.core.sparsify import is_sparse
from dgc_horovod.summary import log_stats
from dgc_horovod.backends.torch_backend import TorchBackend
from dgc_horovod.torch import elastic
from dgc_horovod.torch.exchange import Exchange, Pending
from dgc_horovod.torch.params import find_parameter, param_group

__all__ = ["DGC"]

class DGC(DGCAdapter, Compressor):
    """Deep Gradient Compression as a Horovod compressor (Lin et al., ICLR 2018).

    Keyword arguments are those of :class:`dgc_horovod.core.DGCConfig` (compress_ratio=0.004,
    momentum=0.9, nesterov=False, momentum_masking=True, clip_norm=None, clip_scope="global",
    weight_decay=0.0, weight_decay_mode="separate", sample_ratio=0.01, exact_topk=False,
    min_sparse_numel=1, min_sparse_ndim=2, warmup_steps=1000, warmup_epochs=None,
    warmup_initial_density=0.25, warmup_per_step=False, seed=0, wire_index="delta16",
    wire_values="float32", bucket_numel=2**22), or pass ``config=DGCConfig(...)``.

    Use one DGC object per DistributedOptimizer (a second optimizer is refused), created
    identically on every rank. The sparsity warm-up counts DGC's own optimizer steps
    (``warmup_steps``, default 1000: set it to about 2.5% of your run); with
    ``warmup_epochs=...`` it follows ``set_epoch(epoch)`` instead, which must then be called
    every epoch (DGC warns when it never is).

    Checkpoint and resume: DGC state is per rank (each rank's residual v holds the part of its own
    gradients it has not sent yet), so each rank saves its own file, e.g.
    ``torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
    "dgc": dgc.state_dict()}, f"ckpt.rank{hvd.rank()}.pt")``, and on resume loads that same
    file on the same rank of a job of the same size with ``dgc.load_state_dict(ckpt["dgc"])``;
    training then continues bit-identically to an uninterrupted run. Loading with a different
    config, world size or rank raises ValueError; ``load_state_dict(sd, reset_residuals=True)``
    keeps config, warm-up epoch and sampling generator but drops the velocities and residuals
    (the dropped residual is lost gradient, a small one-off perturbation), e.g. to resume on a
    different number of ranks.

    Horovod Elastic: ``hvd.elastic.TorchState(model=model, optimizer=opt, dgc=dgc, ...)`` commits
    and restores this object with the model (see :mod:`dgc_horovod.torch.elastic`); at every
    reset each rank drops its velocities and residuals (:meth:`on_reset`).

    Attributes:
        config (DGCConfig): the settings. stats (CompressionStats): the most recent step's
        counters for this rank (elements selected, wire bytes, dense bytes, ratio). total_stats:
        cumulative counters. density (float): the density in force (warm-up). resets (int): how
        many times the elastic reset rule was applied on this rank (:meth:`on_reset`).

    Raises (from compress, i.e. from ``loss.backward()``):
        TypeError: a non-floating gradient. ValueError: momentum set both here and in the wrapped
        optimizer; a parameter whose size changed. RuntimeError: used outside
        ``hvd.DistributedOptimizer``, or with ``op=hvd.Adasum``.
    """

    _hvd = hvd

    def __init__(self, config=None, **kwargs):
        super().__init__(config, TorchBackend(), **kwargs)
        self._exchange = Exchange(self._core, self.config.bucket_numel)
        self._checked = set()
        self._optimizer = None          # weak reference to the one optimizer this DGC serves
        if hvd.is_initialized() and hvd.size() == 1:
            self._warn_single_process()

    # Horovod Compressor API ---------------------------------------------------------------
    def compress(self, tensor):
        """Accumulate ``tensor`` (a parameter's gradient) and start its exchange.

        Returns (tensor for Horovod's allreduce, ctx): a 1-element zero placeholder for a
        sparsified tensor, or the dense momentum-corrected velocity for a small tensor.

        A sparsified tensor is compressed at once with ``bucket_numel=0`` (its payload then goes
        out by its own allgather). In bucketed mode it is only checked and recorded here; its
        bucket is compressed in one ``DGCCore.compress_many`` call when its last sparsified
        member arrives (in that member's compress) or, if still incomplete, when Horovod
        synchronizes (in decompress), and then allgathered.
        """
        opt, p, name = find_parameter(tensor, self)
        self._follow_horovod()
        if self._core.fit_pending:                  # the first step after load_state_dict
            self._core.check_fit(opt._parameter_names.values())
        if name not in self._checked:
            self._check(opt, p, name)
        process_set = opt.process_set
        world = process_set.size()
        average = opt.op == hvd.Average
        exchange = self._exchange
        param = p.detach()
        sparse = is_sparse(tensor.numel(), tensor.dim(), self.config)
        if (exchange.bucketed and sparse) or exchange.gated:
            # Deferring is safe: Horovod calls compress from the gradient hook once the gradient
            # is final (with backward_passes_per_step > 1 on the last pass, after accumulation;
            # with zero_grad(set_to_none=True) or False alike, the .grad it hands over is not
            # written again before synchronize(), which decompresses, and so compresses, it
            # first). The tensor (a to_dense() copy for sparse_as_dense) is kept in the launch.
            # Gated (global clipping): dense tensors wait for the step's last gradient too.
            self._core._check_entry(name, tensor, param)
            ctx = Pending(None, None, tensor.shape, tensor.dtype, world, average, name, param,
                           dense=not sparse)
            if sparse:
                exchange.defer(opt, name, tensor, param, process_set, ctx)
            else:
                exchange.defer_dense(opt, name, tensor, param, process_set, ctx)
            return tensor.new_zeros(1, dtype=torch.float32), ctx
        kind, out, core_ctx = self._core.compress(name, tensor, world, param, average)
        # Both go through Horovod's allreduce as float32 (what the statistics count), whatever
        # the gradient's dtype: Horovod's torch collectives have no bfloat16, and a float16
        # placeholder would make the counted wire bytes wrong. decompress casts back.
        if kind == "dense":
            exchange.hold()
            return out.view(tensor.shape), (tensor.shape, tensor.dtype, name, param)
        ticket = exchange.send(name, out, process_set)
        ctx = Pending(ticket, core_ctx, tensor.shape, tensor.dtype, world, average, name, param)
        return tensor.new_zeros(1, dtype=torch.float32), ctx

    def decompress(self, tensor, ctx):
        """Return the averaged (or summed) gradient for Horovod to set as ``p.grad``."""
        if ctx is None:                       # Horovod's sparse (two-allgather) path
            return tensor
        core = self._core
        if not isinstance(ctx, Pending):     # dense tensor: Horovod's allreduce already reduced
            shape, dtype, name, param = ctx
            self._exchange.release()
            return core.apply_weight_decay(name, tensor.view(-1), param).view(shape).to(dtype)
        gathered, ranks = self._exchange.receive(ctx.handle, ctx.world_size)
        if ctx.dense:                         # gated: reduced by DGC's own allreduce
            dense = gathered.view(-1)
        else:
            dense = core.decompress(gathered, ctx.core_ctx, ctx.world_size, ctx.average, ranks)
        dense = core.apply_weight_decay(ctx.name, dense, ctx.param)
        return dense.view(ctx.shape).to(ctx.dtype)

    # Horovod Elastic (the rule and the handler's operations: dgc_horovod.adapter) --------------
    _horovod_session = staticmethod(elastic.horovod_session)

    def _drop_pending(self):
        self._exchange = Exchange(self._core, self.config.bucket_numel)

    def _drop_checks(self):
        self._checked = set()

    def _between_steps(self, what, when):
        """RuntimeError when a step is in progress (between backward() and optimizer.step()):
        the residuals would then already hold this step's accumulation, the model not."""
        if self._exchange.busy():
            raise RuntimeError(f"DGC: {what} in the middle of a step (between loss.backward() and "
                               f"optimizer.step(): the residuals already hold this step's "
                               f"gradient, the parameters do not yet); {when}")

    def state_dict(self, process_set=None):
        self._between_steps("state_dict() was called", "call it between steps, after "
                            "optimizer.step(), as for the model's and the optimizer's")
        return super().state_dict(process_set)

    state_dict.__doc__ = DGCAdapter.state_dict.__doc__ + """
        Raises RuntimeError in the middle of a step (between ``loss.backward()`` and
        ``optimizer.step()``).
        """

    def _check(self, opt, p, name):
        owner = self._optimizer() if self._optimizer is not None else None
        if owner is None:
            self._optimizer = weakref.ref(opt)
        elif owner is not opt:
            raise ValueError("one DGC object is the compression of two DistributedOptimizers; "
                             "its per-parameter residuals would mix the two models' gradients. "
                             "Create one DGC(...) per optimizer.")
        group = param_group(opt, p)
        if group is not None:
            if "betas" in group and self.config.momentum > 0 and not self._checked:
                warnings.warn(
                    f"{type(opt).__mro__[1].__name__} keeps its own moment estimates; DGC("
                    f"momentum={self.config.momentum}) adds momentum correction on top. For "
                    "Adam-like optimizers use DGC(momentum=0) (error feedback only).")
            self._check_momentum(name, opt, group.get("momentum", 0.0) or 0.0)
        self._checked.add(name)



#: Horovod-style namespace of compressors: ``Compression.dgc(**kwargs)`` makes a new :class:`DGC`.
Compression = compression_namespace(hvd, DGC, user="optimizer", usage=(
    "opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),\n"
    "                                   compression=compression)"))


__all__ += ["Compression", "log_stats"]

elastic.register(DGC)       # DGC's TorchState handler
