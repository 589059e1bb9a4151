"""What :mod:`dgc_horovod.tensorflow` does with Keras: the warning that Keras 3 cannot drive
``horovod.tensorflow`` (:func:`warn_if_keras3`) and the refusal of a loss scaler, whose scale a
Keras LossScaleOptimizer changes inside the traced step (:func:`refuse_loss_scaler`), both when
the DGC is made; the momentum of a wrapped Keras optimizer (:func:`momentum_of`, for the
momentum-twice check); and the callbacks (:class:`DGCWarmupCallback`,
:class:`DGCTensorBoardCallback`).
"""
import warnings

import tensorflow as tf

try:
    import tf_keras as _keras
except ImportError:     # pragma: no cover - tf-keras is what horovod.tensorflow.keras needs
    _keras = tf.keras

__all__ = ["DGCWarmupCallback", "DGCTensorBoardCallback", "momentum_of", "weight_decay_of",
           "has_moments", "warn_if_keras3", "refuse_loss_scaler"]

_KERAS3_HINT = ("tf.keras is Keras 3 here: horovod.tensorflow 0.28 calls .ref() and .assign() on "
                "variables and fails on Keras 3 models (DistributedGradientTape with "
                "model.trainable_variables, broadcast_variables, the Keras DistributedOptimizer). "
                "Fix: pip install --no-deps tf-keras==<your TF version> and set "
                "TF_USE_LEGACY_KERAS=1 before importing tensorflow. Plain tf.Variables work "
                "either way.")


def warn_if_keras3():
    """Warn, with the fix, when ``tf.keras`` is Keras 3."""
    if str(getattr(tf.keras, "__version__", "2")).startswith("3"):
        warnings.warn(_KERAS3_HINT)


def refuse_loss_scaler(kwargs):
    """TypeError, with the reason, for a ``loss_scaler`` among a TensorFlow DGC's ``kwargs``."""
    if "loss_scaler" in kwargs:
        raise TypeError(
            "loss_scaler= is supported by dgc_horovod.torch.DGC only: the TensorFlow DGC "
            "cannot follow a Keras LossScaleOptimizer's scale (it changes inside the traced "
            "training step). Under a LossScaleOptimizer DGC sees the scaled gradients: keep "
            "clip_norm unset and weight decay in the optimizer (docs/reliability.md, "
            "\"Mixed precision\")")


def _hyper_of(optimizer, name):
    """A number hyper-parameter of a (Horovod-wrapped) Keras optimizer, read eagerly: a legacy
    optimizer (``tf.keras.optimizers.legacy``) keeps it in a ``tf.Variable``, which reads as a
    symbolic tensor in the traced step. 0.0 for a tape, or where it is None or not a number (a
    schedule)."""
    with tf.init_scope():
        m = getattr(optimizer, name, None)
        if m is None and hasattr(optimizer, "_get_hyper"):
            try:
                m = optimizer._get_hyper(name)
            except (KeyError, AttributeError):
                m = None
        try:
            return float(m) if m is not None else 0.0
        except (TypeError, ValueError):
            return 0.0


def momentum_of(optimizer):
    """The momentum hyper-parameter of a (Horovod-wrapped) Keras optimizer; 0.0 for a tape."""
    return _hyper_of(optimizer, "momentum")


def has_moments(optimizer):
    """Whether a (Horovod-wrapped) Keras optimizer keeps its own moment estimates (Adam-like:
    it has ``beta_1``)."""
    return getattr(optimizer, "beta_1", None) is not None


def weight_decay_of(optimizer):
    """The weight decay of a (Horovod-wrapped) Keras optimizer (its ``weight_decay``, None by
    default); 0.0 for a tape or a legacy optimizer (which has none)."""
    return _hyper_of(optimizer, "weight_decay")


class DGCWarmupCallback(_keras.callbacks.Callback):
    """Keras callback: drive DGC's sparsity warm-up by epoch when ``warmup_epochs`` is set (the
    analogue of Horovod's LearningRateWarmupCallback), and log DGC's per-epoch figures.

    With ``warmup_epochs`` set, ``on_epoch_begin(epoch)`` calls ``dgc.set_epoch(epoch)``. By
    default (``warmup_epochs=None``) DGC counts its own optimizer steps (``warmup_steps``) and
    needs no callback; this one then leaves the warm-up alone (it does not call ``set_epoch``,
    which would only warn that it has no effect). Either way ``on_epoch_end`` adds
    ``dgc_density`` (the density in force), ``dgc_ratio`` and ``dgc_received_ratio`` (this rank's
    wire compression over the epoch: dense bytes over the bytes it sent, and over the bytes it
    received) to the logs."""

    def __init__(self, dgc):
        super().__init__()
        self.dgc = dgc
        self._start = None

    def on_epoch_begin(self, epoch, logs=None):
        if self.dgc.config.warmup_epochs is not None:
            self.dgc.set_epoch(epoch)
        self._start = self.dgc.total_stats.copy()

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None and self._start is not None:
            logs["dgc_density"] = self.dgc.density
            stats = self.dgc.total_stats.since(self._start)
            logs["dgc_ratio"], logs["dgc_received_ratio"] = stats.ratio, stats.received_ratio


class DGCTensorBoardCallback(_keras.callbacks.Callback):
    """Keras callback: write each epoch's DGC statistics as TensorBoard scalars.

    At the end of every epoch it writes ``prefix + name`` for name in
    :data:`dgc_horovod.summary.STATS_SCALARS` (density, ratio, received_ratio, selected,
    wire_bytes, received_bytes, dense_bytes, compress_seconds, nonfinite_tensors,
    overflowed_entries, flushed_entries), counted over that epoch for this rank, at
    step ``epoch`` (0-based, as Keras's own ``TensorBoard`` callback does for its ``epoch_*``
    scalars, so both line up). Add it on rank 0 only::

        if hvd.rank() == 0:
            callbacks.append(DGCTensorBoardCallback(dgc, log_dir="runs/dgc"))

    It does not set the warm-up epoch: use it together with :class:`DGCWarmupCallback`.

    Args:
        dgc (DGC): the compressor.
        log_dir (str): directory for a new event file (written by
            :class:`dgc_horovod.summary.EventWriter`, which needs the ``tensorboard`` package); or
        writer: an existing writer instead: anything with ``add_scalar(tag, value, step)``, or a
            ``tf.summary`` writer (``tf.summary.create_file_writer(...)``). Exactly one of the two.
        prefix (str): tag prefix.
    """

    def __init__(self, dgc, log_dir=None, writer=None, prefix="dgc/"):
        super().__init__()
        if (log_dir is None) == (writer is None):
            raise ValueError("DGCTensorBoardCallback: pass exactly one of log_dir and writer")
        self.dgc, self.prefix = dgc, prefix
        if writer is None:
            from dgc_horovod.summary import EventWriter
            writer = EventWriter(log_dir)
        self.writer = writer
        self._start = None

    def on_epoch_begin(self, epoch, logs=None):
        self._start = self.dgc.total_stats.copy()

    def on_epoch_end(self, epoch, logs=None):
        from dgc_horovod.summary import STATS_SCALARS
        if self._start is None:
            return
        values = self.dgc.total_stats.since(self._start).to_dict()
        w = self.writer
        if hasattr(w, "add_scalar"):
            for name in STATS_SCALARS:
                w.add_scalar(self.prefix + name, values[name], epoch)
        else:       # tf.summary.write: unlike tf.summary.scalar, it needs no tensorboard package
            meta = tf.compat.v1.SummaryMetadata()
            meta.plugin_data.plugin_name = "scalars"
            with w.as_default():
                for name in STATS_SCALARS:
                    tf.summary.write(self.prefix + name, tf.constant(float(values[name]), tf.float32),
                                     step=epoch, metadata=meta)
        w.flush()

    def on_train_end(self, logs=None):
        self.writer.flush()         # not closed: fit() may be called again
