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
* **State** (velocity u, residual v) is held by the framework-agnostic core. The per-step work
  (accumulate, select, encode; later decode) runs eagerly in ``tf.py_function`` ops placed in the
  traced graph, so Python-side settings such as the warm-up density take effect without
  retracing. Where TensorFlow sees no GPU the core runs on NumPy arrays and the fused C kernels;
  with a GPU, on eager TensorFlow ops and ``tf.Variable``s (:mod:`dgc_horovod.tensorflow.host`).
* **Exchange.** A sparsified tensor's payload goes through ``hvd.allgather`` (an op in the same
  graph); Horovod's own allreduce gets a 1-element placeholder (this rank's entry count). Small
  tensors (``min_sparse_numel``) send their momentum-corrected velocity through it instead.
* ``tf.IndexedSlices`` gradients (embeddings) keep Horovod's own allgather path, untouched by DGC,
  unless ``sparse_as_dense=True`` turns them into dense gradients, which DGC then compresses.
* **Rank mismatches.** The first time ``compress`` sees a list of variables (at trace time), the
  ranks compare it and raise a ValueError naming the first difference on every rank, not hang.
* One process: Horovod skips the reduction (and DGC, and so its momentum); DGC warns.
* Global clipping: :mod:`~dgc_horovod.tensorflow.clipping` (one factor per traced step); Horovod
  Elastic: :mod:`~dgc_horovod.tensorflow.elastic`; Keras callbacks:
  :mod:`~dgc_horovod.tensorflow.keras` (Keras 3 breaks ``horovod.tensorflow``: use tf-keras).
"""
import horovod.tensorflow as hvd
import tensorflow as tf
from horovod.tensorflow.compression import Compressor

from dgc_horovod.adapter import DGCAdapter, compression_namespace
from dgc_horovod.core.sparsify import is_sparse
from dgc_horovod.tensorflow.keras import (DGCTensorBoardCallback, DGCWarmupCallback, momentum_of,
                                          refuse_loss_scaler, warn_if_keras3)
from dgc_horovod.tensorflow.clipping import StepClipScale
from dgc_horovod.tensorflow.host import Host, check_traced, make_backend
from dgc_horovod.tensorflow.variables import (ComparedModels, StateNames, collective_name,
                                              find_variable)

__all__ = ["DGC", "DGCWarmupCallback"]


class DGC(DGCAdapter, Compressor):
    """Deep Gradient Compression as a Horovod TensorFlow compressor (Lin et al., ICLR 2018).

    Keyword arguments are those of :class:`dgc_horovod.core.DGCConfig`, or ``config=DGCConfig``;
    ``device`` ("cpu", "gpu"; None: "gpu" if TensorFlow sees one) picks where the per-step work
    runs (:func:`~dgc_horovod.tensorflow.host.make_backend`). Use one DGC per optimizer / tape,
    created identically on every rank, with an optimizer without momentum when DGC's momentum
    > 0 (DGC applies momentum correction itself).

    Attributes: config, stats (last step's CompressionStats of this rank), total_stats, density,
    states (TensorState by variable name), resets (elastic resets applied, :meth:`on_reset`).

    Horovod Elastic: ``dgc_horovod.tensorflow.elastic.TensorFlowKerasState(model, opt, dgc=dgc)``
    (or ``TensorFlowState``, ``KerasState``) carries it; it cannot be pickled or copied.

    Raises (while Horovod traces its reduction): RuntimeError when used outside
    DistributedGradientTape / DistributedOptimizer, with op=Adasum or under jit_compile=True;
    TypeError for a non-floating gradient; ValueError when the ranks reduce different variables
    (names, shapes, dtypes or order; checked once per variable list, the message names the first
    difference).
    """

    _hvd = hvd

    def __init__(self, config=None, *, device=None, **kwargs):
        refuse_loss_scaler(kwargs)
        super().__init__(config, make_backend(device), **kwargs)
        self._host = Host(self._core.B)
        self._names = StateNames()
        self._pending = {}      # between compress and decompress: name -> (ctx, words, world)
        self._models = ComparedModels()     # variable lists already compared across ranks
        self._clip_scale = StepClipScale(self._core, self._follow_horovod, self._host)
        warn_if_keras3()

    # Horovod Compressor API ---------------------------------------------------------------
    @tf.autograph.experimental.do_not_convert
    def compress(self, tensor):
        """Trace-time: place DGC's ops for ``tensor`` in the graph; return (to allreduce, ctx)."""
        check_traced(tensor)
        var, op, process_set, owner, reduced = find_variable(tensor)
        self._check_momentum(var.name, owner, momentum_of(owner))
        if op is not None and op not in (hvd.Average, hvd.Sum):
            raise RuntimeError("DGC supports op=hvd.Average and op=hvd.Sum, not Adasum")
        process_set = hvd.global_process_set if process_set is None else process_set
        if process_set.size() > 1:
            self._models.check(*reduced, process_set)
        else:
            self._warn_single_process()
        name = self._names.of(var)
        numel = tensor.shape.num_elements()
        if numel is None:
            raise ValueError(f"DGC needs a static shape for {name!r}'s gradient: {tensor.shape}")
        core, pending, host, variables = self._core, self._pending, self._host, reduced[1]
        sparse = is_sparse(numel, len(tensor.shape), self.config)
        average = op is None or op == hvd.Average
        scale = self._clip_scale(reduced[0], tensor, process_set, average)

        def run_compress(grad, param, clip_scale):
            # The world size is read when the step runs, not when it was traced: an elastic
            # reset changes it without retracing (Keras keeps its train function).
            self._follow_horovod()
            now = process_set.size()
            if core.fit_pending:                    # the first step after load_state_dict:
                core.check_fit(self._names.known(variables))    # every variable reduced
            kind, out, ctx = core.compress(name, host(grad), now, host(param), average,
                                           float(clip_scale) if core.needs_clip_scale else None)
            if kind == "sparse":                    # and the allgather's input size
                pending[name] = (ctx, core.B.numel(out), now)
            return tf.convert_to_tensor(out)

        param = tf.cast(var, host.dtype(var)) if core.needs_param else tf.zeros([0])
        tensor_in = tf.cast(tensor, host.dtype(tensor))
        if not sparse:
            velocity = tf.py_function(run_compress, [tensor_in, param, scale], tf.float32)
            return (tf.cast(tf.reshape(velocity, tensor.shape), tensor.dtype),
                    (None, tensor, name, var))
        payload = tf.py_function(run_compress, [tensor_in, param, scale], tf.int32)
        payload.set_shape([None])
        gathered = hvd.allgather(payload, name=collective_name(name), process_set=process_set)
        # The 1-element placeholder for Horovod's allreduce is this rank's entry count (word 2 of
        # the payload), not a constant: TensorFlow's graph optimizer folds a collective whose
        # input is constant, which would run it once instead of every step.
        placeholder = tf.cast(payload[2:3], tensor.dtype)
        return placeholder, ((name, average, gathered), tensor, name, var)

    @tf.autograph.experimental.do_not_convert
    def decompress(self, tensor, ctx):
        """Trace-time: decode the allgathered payloads (dense update), or pass a dense result;
        with ``weight_decay_mode="separate"`` the weight decay term is added to either."""
        info, original, name, var = ctx
        core, pending, host = self._core, self._pending, self._host
        separate_wd = core.separate_weight_decay
        if info is None:
            if not separate_wd:
                return tensor

            def run_wd(update, param):
                flat = core.B.float32_flat(host(update))
                return tf.convert_to_tensor(core.apply_weight_decay(name, flat, host(param)))

            dense = tf.py_function(run_wd, [tf.cast(tensor, host.dtype(tensor)),
                                            tf.cast(var, host.dtype(var))], tf.float32)
            return tf.cast(tf.reshape(dense, original.shape), original.dtype)
        _, average, gathered = info

        def run_decompress(g, _placeholder, param):
            ctx, words, world = pending.pop(name)
            g = host(g)
            core.count_allgather(core.B.numel(g), words)
            out = core.decompress(g, ctx, world, average)
            if separate_wd:
                out = core.apply_weight_decay(name, out, host(param))
            return tf.convert_to_tensor(out)

        param = tf.cast(var, host.dtype(var)) if separate_wd else tf.zeros([0])
        dense = tf.py_function(run_decompress, [gathered, tensor, param], tf.float32)
        return tf.cast(tf.reshape(dense, original.shape), original.dtype)

    # checkpoints and Horovod Elastic (the rule: dgc_horovod.adapter; states: elastic.py) ------
    def load_state_dict(self, state_dict, reset_residuals=False, process_set=None):
        current = self._core.B.generator_state(self._core._generator)
        super().load_state_dict(self._host.portable(state_dict, current), reset_residuals,
                                process_set)
        self._drop_pending()

    load_state_dict.__doc__ = DGCAdapter.load_state_dict.__doc__

    def _drop_pending(self):
        self._pending.clear()

    def _elastic_sync_more(self):
        self._models.sync()     # the model signatures already compared

    _copy_hint = ("For Horovod Elastic, pass it to a state of dgc_horovod.tensorflow.elastic "
                  "(TensorFlowKerasState, TensorFlowState or KerasState; Horovod's own would "
                  "pickle it), whose commit, restore and sync carry it; to checkpoint, save "
                  "dgc.state_dict()")


#: Horovod-style namespace of compressors: ``Compression.dgc(**kwargs)`` makes a new :class:`DGC`.
Compression = compression_namespace(hvd, DGC, user="tape or optimizer", usage=(
    "tape = hvd.DistributedGradientTape(tape, compression=compression)"))

__all__ += ["Compression", "DGCTensorBoardCallback"]
