"""Horovod Elastic support for :class:`dgc_horovod.torch.DGC`: a ``TorchState`` handler.

Pass the DGC object to Horovod's own state object, next to the model and the optimizer::

    dgc = DGC(compress_ratio=0.001)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=dgc)
    state = hvd.elastic.TorchState(model=model, optimizer=opt, dgc=dgc, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state):
        ...; opt.step(); state.commit()

Importing :mod:`dgc_horovod.torch` registers :class:`DGCStateHandler` in Horovod's handler
registry (``horovod.torch.elastic.state.set_handler_registry``, Horovod's extension point for
state types), so ``TorchState`` treats a DGC keyword like a model or an optimizer:

* ``commit()`` / ``save()``: a copy of this rank's DGC state (every tensor's velocity u and
  residual v, warm-up epoch, statistics). Refused with a RuntimeError in the
  middle of a step (an exchange pending): commit between steps.
* ``restore()`` (Horovod calls it after a HorovodInternalError): back to the committed state,
  bit for bit; pending exchanges are dropped.
* ``sync()`` (collective, after a reset and at the start): the ranks compare their DGC configs
  (a ValueError on every rank, naming the settings, if they differ) and every rank takes rank
  0's warm-up position (epoch, step count).

**The reset rule.** At every reset (``hvd.elastic.run`` re-initializes Horovod when a worker
leaves or joins, or after a HorovodInternalError) every rank drops its velocities and residuals,
its bucket plans and its first-step checks, whatever the cause; see :meth:`DGC.on_reset`. DGC
applies it by itself at ``sync`` or, when Horovod skips ``sync`` (only workers removed), at the
first step after the reset. Residuals are per rank: a leaving worker's residual is lost with it
and a joining worker has none, so keeping the survivors' would mix ranks whose unsent gradient
sums differ in age and scale (1/N of another N). Dropping everywhere makes every rank start the
new world from the same zero state; the cost is the unsent gradient at the time of the reset, a
one-off perturbation comparable to the steps since the last commit that a failure loses anyway.
"""
import horovod.torch as hvd
from horovod.torch import mpi_ops as _mpi_ops
from horovod.torch.elastic import state as _hvd_state

from dgc_horovod.adapter import ElasticHandler

__all__ = ["DGCStateHandler", "register", "horovod_session"]


class DGCStateHandler(ElasticHandler, _hvd_state.StateHandler):
    """``horovod.torch.elastic.TorchState`` handler of a :class:`dgc_horovod.torch.DGC`: the
    shared :class:`dgc_horovod.adapter.ElasticHandler` as one of Horovod's own handlers.

    Args:
        dgc (DGC): the compressor (``TorchState(..., dgc=dgc)``); its state is copied now, so a
            restore before the first commit goes back to the state at creation.
    Raises (from save): RuntimeError in the middle of a step. (from sync): ValueError when the
        ranks' DGC configs differ.
    """


def register(dgc_class):
    """Add ``(dgc_class, DGCStateHandler)`` to Horovod's TorchState handler registry (once)."""
    registry = _hvd_state.get_handler_registry()
    if not any(cls is dgc_class for cls, _ in registry):
        _hvd_state.set_handler_registry(list(registry) + [(dgc_class, DGCStateHandler)])


def horovod_session():
    """An object that identifies the current Horovod initialization (what the reset rule
    compares to notice a reset).

    ``horovod.torch.init()`` (0.28) binds a new ``mpi_ops._handle_map`` dict at every call, and
    ``hvd.elastic.run`` calls ``shutdown(); init()`` at every reset, so a different object means
    Horovod was re-initialized. Without that attribute (another Horovod version), the (size, rank)
    pair stands in for it.
    """
    marker = getattr(_mpi_ops, "_handle_map", None)
    if isinstance(marker, dict):
        return marker
    return (hvd.size(), hvd.rank()) if hvd.is_initialized() else None
