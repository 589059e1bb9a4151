"""DGC for TensorFlow 2: a Horovod ``Compressor`` for ``hvd.DistributedGradientTape`` and the Keras
``hvd.DistributedOptimizer`` (tf-keras, ``TF_USE_LEGACY_KERAS=1``).

Usage::

    import horovod.tensorflow as hvd
    from dgc_horovod.tensorflow import DGC
    dgc = DGC(compress_ratio=0.004, momentum=0.9)
    tape = hvd.DistributedGradientTape(tape, compression=dgc)       # optimizer: SGD, momentum 0

    import horovod.tensorflow.keras as hvd                           # TF_USE_LEGACY_KERAS=1
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1 * hvd.size()), compression=dgc)
    model.fit(..., callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                              DGCWarmupCallback(dgc)])

How it rides on stock Horovod (0.28.x, unmodified):

* Horovod's ``allreduce_grads(grads, vars)`` calls ``compress(grad)`` while it traces, with the
  gradient only. **Which variable is this?** DGC finds it on the Python stack at trace time
  (:mod:`dgc_horovod.tensorflow.variables`): each variable gets the same state key and collective
  name on every rank (its ``var.name``; ``name#2`` for a second variable of the same name).
* **The steps in the graph** (default, ``in_graph=True``): DGC's per-step work (warm-up density,
  clipping, momentum correction, selection, encoding, and after the exchange decoding and
  averaging) is TensorFlow ops traced into the step, on state held in ``tf.Variable`` objects
  (:mod:`dgc_horovod.tensorflow.graph`): nothing returns to Python per step, the ops run where
  TensorFlow places them. On a CPU the results are the core's reference engine's, bit for bit
  (``tests/test_tf_graph.py``); on a GPU not measured (no GPU machine here has Horovod).
  ``in_graph=False`` runs the core eagerly in ``tf.py_function`` ops instead
  (:class:`~dgc_horovod.tensorflow.host.HostPath`): on NumPy arrays and the C engine where
  TensorFlow sees no GPU, on eager TensorFlow ops with one.
* **Exchange.** The sparsified tensors' payloads go through ``hvd.allgather`` (an op in the same
  graph), one per bucket (``bucket_numel``, cut as PyTorch's plan cuts it, over the gradients in
  Horovod's order; ``bucket_numel=0`` and ``in_graph=False``: one per tensor); Horovod's own
  allreduce gets a 1-element placeholder, which the graph does not use (so TensorFlow prunes
  that allreduce; ``in_graph=False`` sends it: this rank's entry count). Small tensors
  (``min_sparse_numel``) send their momentum-corrected velocity through it instead.
* ``tf.IndexedSlices`` gradients (embeddings) keep Horovod's own allgather path, untouched by DGC,
  unless ``sparse_as_dense=True`` turns them into dense gradients, which DGC then compresses.
* **Rank mismatches.** The first time ``compress`` sees a list of variables (at trace time), the
  ranks compare it and raise a ValueError naming the first difference on every rank, not hang.
* One process: Horovod skips the reduction (and DGC, and so its momentum); DGC warns.
* Global clipping: one factor per traced step (in the graph; ``in_graph=False``:
  :mod:`~dgc_horovod.tensorflow.clipping`); Horovod Elastic: :mod:`~dgc_horovod.tensorflow.elastic`
  (the world size is Horovod's size op under ``HOROVOD_ELASTIC=1``); Keras callbacks:
  :mod:`~dgc_horovod.tensorflow.keras` (Keras 3 breaks ``horovod.tensorflow``: use tf-keras).
"""
import horovod.tensorflow as hvd
import tensorflow as tf
from horovod.tensorflow.compression import Compressor

from dgc_horovod.adapter import DGCAdapter, compression_namespace
from dgc_horovod.backends.tf_backend import TFBackend
from dgc_horovod.core import DGCCore
from dgc_horovod.tensorflow.graph import GraphCore, GraphPath
from dgc_horovod.tensorflow.keras import (DGCTensorBoardCallback, DGCWarmupCallback, momentum_of,
                                          has_moments, refuse_loss_scaler, warn_if_keras3,
                                          weight_decay_of)
from dgc_horovod.tensorflow.host import Host, HostPath, check_traced, make_backend
from dgc_horovod.tensorflow.variables import ComparedModels, StateNames, find_variable

__all__ = ["DGC", "DGCWarmupCallback"]


_MADE_IN_TRACE = """a DGC (DGC(...) or Compression.dgc(...)) was made inside a tf.function while
TensorFlow traced it. Unlike Horovod's stateless compressors, DGC keeps state from step to step
(each variable's velocity and residual, the warm-up position, the statistics): one made in the
step would start from nothing at every trace (TensorFlow traces a step more than once) and stay out
of reach of set_epoch, dgc.stats and checkpoints. Create it once, outside the step, and pass it in:

    dgc = DGC(compress_ratio=0.004, momentum=0.9)   # once, before the training loop

    @tf.function
    def training_step(images, labels):
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
        tape = hvd.DistributedGradientTape(tape, compression=dgc)
        ..."""


_RUN_EAGERLY = ("DGC (in_graph=True, the default) traces its ops into Horovod's reduction, and "
                "tf.config.run_functions_eagerly(True) runs that reduction eagerly instead, as it "
                "runs every tf.function. To debug eagerly, use DGC(..., in_graph=False), which "
                "runs the same steps in eager code; or call tf.config.run_functions_eagerly("
                "False) before training")


class DGC(DGCAdapter, Compressor):
    """Deep Gradient Compression as a Horovod TensorFlow compressor (Lin et al., ICLR 2018).

    Keyword arguments are those of :class:`dgc_horovod.core.DGCConfig`, or ``config=DGCConfig``.
    ``in_graph`` (default True): DGC's per-step work is TensorFlow ops traced into the step
    (:mod:`~dgc_horovod.tensorflow.graph`); False runs it in ``tf.py_function`` ops
    (:class:`~dgc_horovod.tensorflow.host.HostPath`), where ``device`` ("cpu", "gpu"; None:
    "gpu" if TensorFlow sees one) picks the core's backend: the C kernels on "cpu", eager
    TensorFlow ops on "gpu". Use one DGC per optimizer / tape, created identically on every
    rank, with an optimizer without momentum when DGC's momentum > 0 (DGC applies momentum
    correction itself).

    Attributes: config, stats (last step's CompressionStats of this rank), total_stats, density,
    states (TensorState by variable name), resets (elastic resets applied, :meth:`on_reset`).

    Horovod Elastic: ``dgc_horovod.tensorflow.elastic.TensorFlowKerasState(model, opt, dgc=dgc)``
    (or ``TensorFlowState``, ``KerasState``) carries it; it cannot be pickled or copied.

    Raises: RuntimeError when created inside a ``tf.function`` (create it once, outside the
    step: the message shows how), and at the first step under
    ``tf.config.run_functions_eagerly(True)`` with ``in_graph=True`` (``in_graph=False`` runs
    there). While Horovod traces its reduction: RuntimeError when used
    outside DistributedGradientTape / DistributedOptimizer, with op=Adasum or under
    jit_compile=True; TypeError for a non-floating gradient; ValueError when the ranks reduce
    different variables (names, shapes, dtypes or order; checked once per variable list, the
    message names the first difference).
    """

    _hvd = hvd
    _own_kwargs = ("device", "in_graph")
    _elastic_state = ("dgc_horovod.tensorflow.elastic.TensorFlowKerasState(model, optimizer, "
                      "dgc=dgc, ...) (or its TensorFlowState / KerasState) in place of "
                      "Horovod's class. Meanwhile DGC skips its check that every rank reduces "
                      "the same model (a worker that joins later would run that check alone "
                      "and wait forever)")

    def __init__(self, config=None, *, device=None, in_graph=True, **kwargs):
        if tf.inside_function():
            raise RuntimeError(_MADE_IN_TRACE)
        refuse_loss_scaler(kwargs)
        if in_graph not in (True, False):
            raise TypeError(f"DGC: in_graph must be True or False, got {in_graph!r}")
        if in_graph and device is not None:
            raise ValueError("DGC: device= picks the backend of in_graph=False; with "
                             "in_graph=True TensorFlow places DGC's ops")
        super().__init__(config, TFBackend() if in_graph else make_backend(device),
                         GraphCore if in_graph else DGCCore, **kwargs)
        if self._core.needs_sketch:
            raise ValueError("DGC: clip_scope='sketch' is available in PyTorch only (so far); "
                             "in TensorFlow use clip_scope='global' (the paper's rule) or "
                             "'tensor'" + self.config._from("clip_scope"))
        self._host = Host(self._core.B)
        self._names = StateNames()
        self._models = ComparedModels()     # variable lists already compared across ranks
        self._path = GraphPath(self) if in_graph else HostPath(self)
        warn_if_keras3()

    # Horovod Compressor API ---------------------------------------------------------------
    @tf.autograph.experimental.do_not_convert
    def compress(self, tensor):
        """Trace-time: place DGC's ops for ``tensor`` in the graph; return (to allreduce, ctx)."""
        if (isinstance(self._path, GraphPath) and tf.executing_eagerly()
                and tf.config.functions_run_eagerly()):
            raise RuntimeError(_RUN_EAGERLY)
        check_traced(tensor)
        var, op, process_set, owner, reduced = find_variable(tensor)
        self._check_optimizer(var.name, owner, momentum_of(owner), weight_decay_of(owner),
                              has_moments(owner))
        if op is not None and op not in (hvd.Average, hvd.Sum):
            raise RuntimeError("DGC supports op=hvd.Average and op=hvd.Sum, not Adasum")
        process_set = hvd.global_process_set if process_set is None else process_set
        if process_set.size() <= 1:
            self._warn_single_process()
        elif not self._uncarried_elastic():     # else a joining worker would compare alone
            self._models.check(*reduced, process_set, self.config)
        self._follow_horovod()
        name = self._names.of(var)
        if tensor.shape.num_elements() is None:
            raise ValueError(f"DGC needs a static shape for {name!r}'s gradient: {tensor.shape}")
        return self._path.compress(tensor, var, name, reduced, process_set,
                                   op is None or op == hvd.Average)

    @tf.autograph.experimental.do_not_convert
    def decompress(self, tensor, ctx):
        """Trace-time: the update from Horovod's result (decoded payloads, or a dense result;
        with ``weight_decay_mode="separate"`` plus the weight decay term)."""
        return self._path.decompress(tensor, ctx)

    # checkpoints and Horovod Elastic (the rule: dgc_horovod.adapter; states: elastic.py) ------
    def load_state_dict(self, state_dict, reset_residuals=False, process_set=None):
        super().load_state_dict(self._host.portable(state_dict), reset_residuals, process_set)
        self._drop_pending()

    load_state_dict.__doc__ = DGCAdapter.load_state_dict.__doc__

    def _drop_pending(self):
        if isinstance(self._path, HostPath):
            self._path.pending.clear()

    def _elastic_sync_more(self):
        self._models.sync()     # the model signatures already compared

    _missing_exchanges = dict.fromkeys(("regions", "hierarchical"), (
        ". It runs in dgc_horovod.torch only: this adapter's exchange is graph ops in Horovod's "
        "graph (dgc_horovod/tensorflow/graph.py) and that one is not written as graph ops; for "
        "multi-GPU nodes (exchange='hierarchical') use PyTorch, or 'allgather' here"))

    _copy_hint = ("For Horovod Elastic, pass it to a state of dgc_horovod.tensorflow.elastic "
                  "(TensorFlowKerasState, TensorFlowState or KerasState; Horovod's own would "
                  "pickle it), whose commit, restore and sync carry it; to checkpoint, save "
                  "dgc.state_dict()")


#: Horovod-style namespace of compressors: ``Compression.dgc(**kwargs)`` makes a new :class:`DGC`.
Compression = compression_namespace(hvd, DGC, user="tape or optimizer", usage=(
    "tape = hvd.DistributedGradientTape(tape, compression=compression)"))

__all__ += ["Compression", "DGCTensorBoardCallback"]
