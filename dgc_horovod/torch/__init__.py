"""DGC for PyTorch: a Horovod ``Compressor`` for ``horovod.torch.DistributedOptimizer``.

Usage (the only change to a Horovod script)::

    import horovod.torch as hvd
    from dgc_horovod.torch import DGC
    dgc = DGC(compress_ratio=0.004, momentum=0.9)       # warm-up: its own step count
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * hvd.size())   # no momentum here: DGC has it
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=dgc)

How it rides on stock Horovod (0.28.x, unmodified, nothing patched):

* Horovod calls ``compress(p.grad)`` when a gradient is ready, allreduces the result under the
  parameter's name and later calls ``decompress(output, ctx)`` in ``synchronize()``.
  **Which parameter is this?** ``compress`` receives only the gradient; DGC finds the parameter
  on the call stack (:mod:`dgc_horovod.torch.params`) and keys its state (velocity u, residual v)
  by the parameter's name from ``named_parameters``, identical on every rank. Called from
  anywhere else, DGC raises a RuntimeError saying how to use it.
* **Exchange** (:mod:`dgc_horovod.torch.exchange`). A sparsified tensor's payload goes out by
  ``hvd.allgather_async``, one per bucket of parameters (``bucket_numel``; started when the
  bucket's last sparsified member arrives, overlapping with the rest of backward) or, with
  ``bucket_numel=0``, one per tensor (``dgc.<parameter name>``); Horovod's own allreduce carries a
  1-element zero placeholder for it. ``decompress`` sums every rank's entries in rank order
  (bit-identical on every rank) and divides by the world size for ``op=hvd.Average``
  (``exchange="regions"``: an alltoall and an allgather instead, docs/scaling.md). Tensors that
  are not sparsified (1-D by default) go through Horovod's dense allreduce as their
  momentum-corrected velocity. With global clipping (``clip_norm``, ``clip_scope="global"``)
  every gradient waits for the step's last one, so the exchange no longer overlaps with backward.
* **One process.** With ``hvd.size() == 1`` Horovod's optimizer never calls the compressor, so DGC
  does nothing at all; DGC warns when it is created after ``hvd.init()`` in a 1-process job.
* **Momentum.** DGC applies momentum itself (momentum correction): create the wrapped optimizer
  with momentum=0 (DGC raises a ValueError at the first step when both are > 0), and weight decay
  belongs in ``DGC(weight_decay=...)`` (docs/usage.md, "Momentum, weight decay and clipping").
"""
import horovod.torch as hvd
import torch
from horovod.torch.compression import Compressor

from dgc_horovod.adapter import DGCAdapter, compression_namespace
from dgc_horovod.core.sparsify import is_sparse
from dgc_horovod.summary import log_stats
from dgc_horovod.backends.torch_backend import TorchBackend
from dgc_horovod.torch import elastic, loss_scale
from dgc_horovod.torch.exchange import Exchange, Pending
from dgc_horovod.torch.hierarchical import Hierarchical, HierarchicalPending
from dgc_horovod.torch.params import (OptimizerChecks, check_one_synchronize, find_parameter,
                                      undo_refused_step)

__all__ = ["DGC"]


class DGC(DGCAdapter, Compressor):
    """Deep Gradient Compression as a Horovod compressor (Lin et al., ICLR 2018).

    Keyword arguments are those of :class:`dgc_horovod.core.DGCConfig` (compress_ratio=0.004,
    momentum=0.9, ... bucket_numel=2**22; its docstring lists them), or ``config=DGCConfig(...)``.

    Use one DGC object per DistributedOptimizer (a second optimizer is refused), created
    identically on every rank. The sparsity warm-up counts DGC's own optimizer steps
    (``warmup_steps``, default 1000: set it to about 2.5% of your run); with
    ``warmup_epochs=...`` it follows ``set_epoch(epoch)`` instead, which must then be called
    every epoch (DGC warns when it never is).

    Checkpoint and resume: DGC state is per rank; each rank saves ``dgc.state_dict()`` in its own
    file and loads it with ``dgc.load_state_dict(sd)`` on the same rank of a job of the same size:
    training continues bit-identically (``reset_residuals=True``: another number of ranks).

    Horovod Elastic: ``hvd.elastic.TorchState(..., dgc=dgc)`` commits and restores it with the
    model; every reset drops this rank's velocities and residuals (:meth:`on_reset`).

    Mixed precision: ``DGC(..., loss_scaler=scaler)`` (a ``torch.amp.GradScaler``): u and v stay
    in the scaler's units, so after ``scaler.unscale_(opt)`` the update is DGC's without one.

    Attributes: config (DGCConfig), stats (the most recent step's CompressionStats of this rank:
    elements selected, wire bytes, dense bytes, ratio), total_stats (cumulative), density (in
    force: warm-up), resets (how many times the elastic reset rule was applied here,
    :meth:`on_reset`).

    Raises (from compress, i.e. from ``loss.backward()``; refused at a step's first gradient,
    the optimizer stays usable):
        TypeError: a non-floating gradient. ValueError: momentum set both here and in the wrapped
        optimizer; a parameter whose size changed; a loaded state that does not fit the model.
        RuntimeError: used outside ``hvd.DistributedOptimizer``, or with ``op=hvd.Adasum``.
    """

    _hvd = hvd
    exchanges = ("allgather", "regions", "hierarchical")
    _own_kwargs = ("loss_scaler",)

    _copy_hint = ("For Horovod Elastic, pass it to hvd.elastic.TorchState(..., dgc=dgc), whose "
                  "commit, restore and sync carry it; to checkpoint, save dgc.state_dict()")

    _elastic_state = "hvd.elastic.TorchState(model=model, optimizer=optimizer, dgc=dgc, ...)"

    def __init__(self, config=None, loss_scaler=None, **kwargs):
        loss_scale.check_loss_scaler(loss_scaler)
        super().__init__(config, TorchBackend(), **kwargs)
        self._loss_scaler = loss_scaler
        self._core.skip_nonfinite_steps = loss_scale.skips_nonfinite_steps(loss_scaler)
        self._exchange = Exchange(self._core, self.config.bucket_numel)
        self._hier = self._new_hierarchical()
        self._checks = OptimizerChecks(self._check_optimizer)
        if hvd.is_initialized() and hvd.size() == 1:
            self._warn_single_process()

    # Horovod Compressor API ---------------------------------------------------------------
    def compress(self, tensor):
        """Accumulate ``tensor`` (a parameter's gradient) and start its exchange. Returns
        (tensor for Horovod's allreduce, ctx): a 1-element zero placeholder for a sparsified
        tensor, or the dense momentum-corrected velocity for a small tensor. With
        ``bucket_numel=0`` a sparsified tensor is compressed and sent at once; in bucketed
        mode it is only checked and recorded here, and its bucket is compressed and sent when its
        last sparsified member arrives or, if still incomplete, in decompress. A refusal of the
        step's first gradient leaves Horovod's optimizer usable (``params.undo_refused_step``).
        """
        opt, p, name = find_parameter(tensor, self)
        check_one_synchronize(opt)
        try:
            return self._compress(opt, p, name, tensor)
        except BaseException:
            if self._exchange.idle:             # DGC took nothing of the step: nor will Horovod
                undo_refused_step(opt)
            raise

    def _compress(self, opt, p, name, tensor):
        self._follow_horovod()
        if self._loss_scaler is not None and self._exchange.idle:    # the step's first gradient
            self._read_loss_scale()
        hier = self._hier
        if hier is None and self._core.fit_pending:     # the first step after load_state_dict
            self._core.check_fit({n: q.numel() for q, n in opt._parameter_names.items()})
        self._exchange.check_model(opt)             # the ranks' models and settings alike
        if hier is not None:        # the nodes (after check_model: every rank takes this way)
            hier.setup(opt)
            if self._core.fit_pending:              # a checkpoint holds this rank's shards
                self._core.check_fit(hier.fit_numels(opt))
        self._checks(opt, p, name)
        process_set, exchange, param = opt.process_set, self._exchange, p.detach()
        world, average = process_set.size(), opt.op == hvd.Average
        if hier is not None:
            return self._compress_hierarchical(name, tensor, param, average)
        sparse = is_sparse(tensor.numel(), tensor.dim(), self.config)
        in_place = tensor.dtype is torch.float32 and tensor.is_contiguous()   # see Pending.out
        into = tensor if sparse and in_place else None
        if (exchange.bucketed and sparse) or exchange.gated:
            # deferred (safe: see Exchange.defer); gated, dense tensors wait for the step too
            self._core.check_entry(name, tensor, param)
            ctx = Pending(None, None, tensor.shape, tensor.dtype, world, average, name, param,
                          dense=not sparse, out=into)
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
        ticket = exchange.send(name, out, process_set, core_ctx.numel)
        ctx = Pending(ticket, core_ctx, tensor.shape, tensor.dtype, world, average, name, param,
                      out=into)
        return tensor.new_zeros(1, dtype=torch.float32), ctx

    def _compress_hierarchical(self, name, tensor, param, average):
        """``exchange="hierarchical"`` (:mod:`dgc_horovod.torch.hierarchical`): a sharded
        tensor's node reduction starts; any other goes through Horovod's allreduce as its
        velocity, as under every exchange (with N = the number of nodes), or with clipping
        starts its node reduction too (for the node's norm)."""
        hier, core = self._hier, self._core
        core.check_floating(name, tensor)
        sharded = hier.sharded(tensor)
        if sharded or core.needs_clip_scale:    # clipping: every tensor waits for the norm
            ctx = hier.start(name, tensor, param, average, sharded)
            self._exchange.hold()
            return tensor.new_zeros(1, dtype=torch.float32), ctx
        g, q = hier.dense_input(name, tensor, param)
        kind, out, _ = core.compress(name, g, hier.layout.nodes_count, q, average)
        self._exchange.hold()
        return out.view(tensor.shape), (tensor.shape, tensor.dtype, name, param)

    def _new_hierarchical(self):
        return Hierarchical(self._core) if self.config.exchange == "hierarchical" else None

    def state_dict(self, process_set=None):
        sd = super().state_dict(process_set)
        if self._hier is not None:          # the shards' layout, which load_state_dict checks
            sd["layout"] = self._hier.layout_dict()
        return sd

    state_dict.__doc__ = DGCAdapter.state_dict.__doc__ + (
        "\n        With ``exchange=\"hierarchical\"`` the dict also holds ``layout``: "
        "{local_size, nodes, shard, shards}\n        (this rank's shard of each sparsified "
        "tensor; shards: the shard rule,\n        ``hierarchical.SHARD_RULE``).\n")

    def load_state_dict(self, state_dict, reset_residuals=False, process_set=None):
        if self._hier is not None and not reset_residuals and isinstance(state_dict, dict):
            now = self._hier.layout_dict()
            saved = state_dict.get("layout")
            if saved is not None and saved != now:  # none: another exchange's (config check)
                raise ValueError(
                    f"DGC checkpoint was saved with the node layout {saved} (local_size: ranks "
                    f"per node, nodes, shard: this rank's place in its node, shards: the rule that "
                    f"cuts a tensor into shards), this job has "
                    f"{now}: with exchange='hierarchical' each rank's state is its shard of the "
                    "node's gradients. Resume on the same layout, or load with "
                    "reset_residuals=True")
        super().load_state_dict(state_dict, reset_residuals, process_set)

    load_state_dict.__doc__ = DGCAdapter.load_state_dict.__doc__

    def decompress(self, tensor, ctx):
        """Return the averaged (or summed) gradient for Horovod to set as ``p.grad``."""
        if ctx is None:                       # Horovod's sparse (two-allgather) path
            return tensor
        if self._loss_scaler is not None:     # the plain scaler.step(opt) loop is refused
            loss_scale.check_not_unscaled(self._loss_scaler, self._checks.optimizer())
        core = self._core
        if isinstance(ctx, HierarchicalPending):    # exchange="hierarchical": finished there
            self._exchange.release()
            return self._hier.receive(ctx).view(ctx.shape).to(ctx.dtype)
        if not isinstance(ctx, Pending):      # dense tensor: Horovod's allreduce already reduced
            shape, dtype, name, param = ctx
            self._exchange.release()
            return core.finish_update(name, tensor.view(-1), param).view(shape).to(dtype)
        gathered, ranks, dropped = self._exchange.receive(ctx.handle, ctx.world_size)
        if ctx.dense:                         # gated: reduced by DGC's own allreduce
            dense = gathered.view(-1)
        elif ranks is None:                   # a bucket's member: decoded with its bucket
            dense = gathered
        else:
            dense = core.decompress(gathered, ctx.core_ctx, ctx.world_size, ctx.average, ranks,
                                    None if ctx.out is None else ctx.out.view(-1), dropped)
        dense = core.finish_update(ctx.name, dense, ctx.param)
        return dense.view(ctx.shape).to(ctx.dtype)

    def _read_loss_scale(self):
        loss_scale.read_loss_scale(self._core, self._loss_scaler)

    # Horovod Elastic (the rule and the handler's operations: dgc_horovod.adapter) --------------
    _horovod_session = staticmethod(elastic.horovod_session)

    def _drop_pending(self):
        self._exchange = Exchange(self._core, self.config.bucket_numel)
        self._hier = self._new_hierarchical()

    def _drop_checks(self):
        self._checks.forget_parameters()

    def _between_steps(self, what, when):
        self._exchange.check_between_steps(what, when)


#: Horovod-style namespace of compressors: ``Compression.dgc(**kwargs)`` makes a new :class:`DGC`.
Compression = compression_namespace(hvd, DGC, user="optimizer", usage=(
    "opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),\n"
    "                                   compression=compression)"))


__all__ += ["Compression", "log_stats"]

elastic.register(DGC)       # DGC's TorchState handler
