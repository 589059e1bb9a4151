"""Horovod Elastic support for :class:`dgc_horovod.tensorflow.DGC`: Horovod's TensorFlow states,
carrying DGC.

Use these classes where a script uses Horovod's: same arguments, plus the DGC object as a keyword
argument, next to the model and the optimizer::

    from dgc_horovod.tensorflow import DGC, elastic as dgc_elastic

    dgc = DGC(compress_ratio=0.001)
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(lr), compression=dgc)    # or a tape
    state = dgc_elastic.TensorFlowKerasState(model, opt, dgc=dgc, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state):
        ...; state.commit()

:class:`TensorFlowKerasState`, :class:`TensorFlowState` and :class:`KerasState` are subclasses of
``horovod.tensorflow.elastic.TensorFlowKerasState`` / ``TensorFlowState`` and
``horovod.tensorflow.keras.elastic.KerasState``: everything Horovod's class does stays, and every
keyword argument that is a DGC is taken out of Horovod's plain-object handling and given
:class:`dgc_horovod.adapter.ElasticHandler`, the one PyTorch's ``TorchState`` handler uses:

* ``commit()`` / ``save()``: a copy of this rank's DGC state (velocities u, residuals v, warm-up
  position, statistics) with the model's.
* ``restore()`` (Horovod calls it after a HorovodInternalError): back to the committed state,
  bit for bit; exchanges of the failed step are dropped.
* ``sync()`` (collective): the ranks compare their DGC configs (a ValueError on every rank,
  naming the settings, if they differ), every rank takes rank 0's warm-up position, and the
  union of the model signatures the ranks have compared.
* ``reset()`` (Horovod calls it at every reset, after re-initializing, whatever the cause):
  DGC's reset rule, :meth:`DGC.on_reset`: every rank drops its velocities and residuals. The
  world size N is read when each step runs, so the traced step (Keras keeps its train function
  across resets) clips and averages with the new N.

Why subclasses: Horovod's TensorFlow states have no handler registry like ``TorchState``'s;
they keep every keyword argument as a plain object (a commit keeps a reference, not a copy,
and ``sync`` broadcasts it by pickling, which would hand the other ranks a detached copy). A DGC
refuses to be pickled with a TypeError that names these classes, so Horovod's own state fails
at its first ``sync`` instead of training with the wrong object.
"""
from horovod.tensorflow import elastic as _hvd_elastic
from horovod.tensorflow.keras import elastic as _hvd_keras_elastic

from dgc_horovod.adapter import ElasticHandler
from dgc_horovod.tensorflow import DGC

__all__ = ["TensorFlowKerasState", "TensorFlowState", "KerasState"]


class _CarriesDGC:
    """What the three states add to Horovod's: the DGC keyword arguments, with their handlers."""

    def __init__(self, *args, **kwargs):
        handlers = {name: ElasticHandler(value) for name, value in kwargs.items()
                    if isinstance(value, DGC)}
        object.__setattr__(self, "_dgc_handlers", handlers)
        super().__init__(*args, **{k: v for k, v in kwargs.items() if k not in handlers})
        for name, handler in handlers.items():
            object.__setattr__(self, name, handler.value)

    def __setattr__(self, name, value):
        handlers = self.__dict__.get("_dgc_handlers", {})
        if name in handlers:
            if not isinstance(value, DGC):
                raise TypeError(f"state.{name} carries a DGC; assign another "
                                f"dgc_horovod.tensorflow.DGC, not {type(value).__name__}")
            handlers[name] = ElasticHandler(value)
        super().__setattr__(name, value)

    def save(self):
        for handler in self._dgc_handlers.values():
            handler.save()
        super().save()

    def restore(self):
        super().restore()
        for handler in self._dgc_handlers.values():
            handler.restore()

    def sync(self):
        super().sync()
        for handler in self._dgc_handlers.values():
            handler.sync()

    def reset(self):
        super().reset()
        for handler in self._dgc_handlers.values():
            handler.value.on_reset()


class TensorFlowKerasState(_CarriesDGC, _hvd_elastic.TensorFlowKerasState):
    """``horovod.tensorflow.elastic.TensorFlowKerasState`` (model, optimizer=None, backend=None,
    **kwargs) that carries the DGC objects among ``kwargs`` (see the module docstring)."""


class TensorFlowState(_CarriesDGC, _hvd_elastic.TensorFlowState):
    """``horovod.tensorflow.elastic.TensorFlowState`` (variables=None, session=None, **kwargs)
    that carries the DGC objects among ``kwargs`` (see the module docstring)."""


class KerasState(_CarriesDGC, _hvd_keras_elastic.KerasState):
    """``horovod.tensorflow.keras.elastic.KerasState`` (model, optimizer=None, **kwargs) that
    carries the DGC objects among ``kwargs`` (see the module docstring)."""
