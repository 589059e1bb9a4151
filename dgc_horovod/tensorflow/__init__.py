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
* **State** (velocity u, residual v) is held by the framework-agnostic core in ``tf.Variable``s
  created eagerly. The per-step work (accumulate, select, encode; later decode) runs eagerly in
  ``tf.py_function`` ops placed in the traced graph, so Python-side settings such as the warm-up
  density take effect without retracing.
* **Exchange.** A sparsified tensor's payload goes through ``hvd.allgather`` (an op in the same
  graph); Horovod's own allreduce gets a 1-element placeholder (this rank's entry count). Small tensors
  (``min_sparse_numel``) send their momentum-corrected velocity through that allreduce instead.
* ``tf.IndexedSlices`` gradients (embeddings) keep Horovod's own allgather path, untouched by DGC,
  unless ``sparse_as_dense=True`` turns them into dense gradients, which DGC then compresses.
* **Rank mismatches.** The first time ``compress`` sees a list of variables (at trace time), the
  ranks compare it (names, shapes, dtypes, order; one pair of eager allgathers) and raise a
  ValueError naming the first differing variable on every rank instead of hanging.
* With a single process Horovod skips the reduction (and so DGC) entirely; DGC warns then, since the
  optimizer would run without the momentum DGC provides.
* **Horovod Elastic.** Pass the DGC object to a state of :mod:`dgc_horovod.tensorflow.elastic`
  (Horovod's ``TensorFlowKerasState``, ``TensorFlowState`` and ``KerasState``, carrying DGC); Horovod's
  own states cannot carry it (a DGC refuses to be pickled and says so). The world size is read when
  a step runs, since a traced step is kept across an elastic reset.
* Keras 3 (the default ``tf.keras`` of TF 2.21) breaks parts of ``horovod.tensorflow`` itself;
  use tf-keras with ``TF_USE_LEGACY_KERAS=1`` (see README).
"""
import json
from contextlib import nullcontext as _nullcontext

import horovod.tensorflow as hvd
import tensorflow as tf
from horovod.tensorflow.compression import Compressor

from dgc_horovod.adapter import DGCAdapter, compression_namespace
from dgc_horovod.core.sparsify import is_sparse
from dgc_horovod.backends.tf_backend import TFBackend
from dgc_horovod.tensorflow.keras import (DGCTensorBoardCallback, DGCWarmupCallback, momentum_of,
                                          warn_if_keras3)
from dgc_horovod.tensorflow.variables import (StateNames, check_same_variables, find_variable,
                                              model_signature)

__all__ = ["DGC", "DGCWarmupCallback"]


class DGC(DGCAdapter, Compressor):
    """Deep Gradient Compression as a Horovod TensorFlow compressor (Lin et al., ICLR 2018).

    Keyword arguments are those of :class:`dgc_horovod.core.DGCConfig`, or ``config=DGCConfig``.
    Use one DGC object per optimizer / tape, created identically on every rank, with an optimizer
    without momentum when DGC's momentum > 0 (DGC applies momentum correction itself).

    Attributes: config, stats (last step's CompressionStats of this rank), total_stats, density,
    states (per-variable TensorState, keyed by variable name), resets (how many times the elastic
    reset rule was applied on this rank, :meth:`on_reset`).

    Horovod Elastic: ``dgc_horovod.tensorflow.elastic.TensorFlowKerasState(model, opt, dgc=dgc,
    ...)`` (or ``TensorFlowState``, ``KerasState``) commits and restores this object with the model.
    It cannot be pickled or copied (TypeError).

    Raises (while Horovod traces its reduction): RuntimeError when used outside
    DistributedGradientTape / DistributedOptimizer or with op=Adasum; TypeError for a
    non-floating gradient; ValueError when the ranks reduce different variables (names,
    shapes, dtypes or order; checked once per variable list with one pair of allgathers, the
    message names the first difference).
    """

    _hvd = hvd

    def __init__(self, config=None, **kwargs):
        super().__init__(config, TFBackend(), **kwargs)
        self._names = StateNames()
        self._pending = {}      # state name -> (SparseContext, payload words, world size)
                                # between compress and decompress
        self._checked_models = set()    # model signatures already compared across ranks
        self._scale = None      # (grads list, graph, clip factor tensor) of the traced step
        warn_if_keras3()

    def load_state_dict(self, state_dict, reset_residuals=False, process_set=None):
        super().load_state_dict(state_dict, reset_residuals, process_set)
        self._drop_pending()

    load_state_dict.__doc__ = DGCAdapter.load_state_dict.__doc__

    # Horovod Elastic (the rule and the state operations: dgc_horovod.adapter; the states that
    # carry a DGC: dgc_horovod.tensorflow.elastic) ---------------------------------------------
    def _drop_pending(self):
        self._pending.clear()

    def _elastic_sync_more(self):
        """Every rank takes the union of the model signatures the ranks have compared. The
        comparison runs, with collectives, while Horovod's reduction is traced; after a reset
        the survivors do not trace again (Keras keeps its train function), so a joining worker,
        which traces alone, must skip the collectives for a model the others already compared.
        (A joining worker whose model differs from every compared one starts the comparison
        alone and waits: Horovod's stall warnings then name DGCCheckModelSizes.)"""
        every = hvd.allgather_object(sorted(self._checked_models), name="dgc.elastic.models")
        self._checked_models = set().union(*every)

    def __reduce_ex__(self, protocol):
        raise TypeError(
            "a dgc_horovod.tensorflow.DGC cannot be pickled or copied: its state is per rank and "
            "lives in tf.Variables. For Horovod Elastic, pass it to a state of "
            "dgc_horovod.tensorflow.elastic (TensorFlowKerasState, TensorFlowState or "
            "KerasState; same arguments as Horovod's), whose commit, restore and sync carry it: "
            "Horovod's own TensorFlow states would broadcast the object by pickling; to "
            "checkpoint, save dgc.state_dict()")

    # Horovod Compressor API ---------------------------------------------------------------
    @tf.autograph.experimental.do_not_convert
    def compress(self, tensor):
        """Trace-time: place DGC's ops for ``tensor`` in the graph; return (to allreduce, ctx)."""
        if not tensor.dtype.is_floating:
            raise TypeError(f"DGC: gradients must be floating-point tensors, got {tensor.dtype}")
        var, op, process_set, owner, reduced = find_variable(tensor)
        self._check_momentum(var.name, owner, momentum_of(owner))
        if op is not None and op not in (hvd.Average, hvd.Sum):
            raise RuntimeError("DGC supports op=hvd.Average and op=hvd.Sum, not Adasum")
        process_set = process_set if process_set is not None else hvd.global_process_set
        world = process_set.size()
        if world > 1:
            signature = model_signature(*reduced)
            key = json.dumps(signature)
            if key not in self._checked_models:
                check_same_variables(signature, process_set)
                self._checked_models.add(key)
        if world == 1:
            self._warn_single_process()
        name = self._names.of(var)
        numel = tensor.shape.num_elements()
        if numel is None:
            raise ValueError(f"DGC needs a static shape for the gradient of {name!r}, got "
                             f"{tensor.shape}")
        core, pending = self._core, self._pending
        sparse = is_sparse(numel, len(tensor.shape), self.config)
        average = op is None or op == hvd.Average
        scale = self._clip_scale(reduced[0], tensor, process_set, average)
        variables = reduced[1]

        def run_compress(grad, param, clip_scale):
            # The world size is read when the step runs, not when it was traced: an elastic
            # reset changes it without retracing (Keras keeps its train function).
            self._follow_horovod()
            now = process_set.size()
            if core.fit_pending:                    # the first step after load_state_dict:
                core.check_fit(self._names.known(variables))    # every variable reduced
            kind, out, ctx = core.compress(name, grad, now, param, average,
                                           float(clip_scale) if core.needs_clip_scale else None)
            if kind == "sparse":                    # and the allgather's input size
                pending[name] = (ctx, core.B.numel(out), now)
            return tf.convert_to_tensor(out)

        param = var if core.needs_param else tf.zeros([0])
        if not sparse:
            velocity = tf.py_function(run_compress, [tensor, param, scale], tf.float32)
            return (tf.cast(tf.reshape(velocity, tensor.shape), tensor.dtype),
                    (None, tensor, name, var))
        payload = tf.py_function(run_compress, [tensor, param, scale], tf.int32)
        payload.set_shape([None])
        # "HorovodAllgather" in the name: hvd.elastic.run (TensorFlow) recognizes a failed
        # Horovod op by its op name in the error message and restores; without it a worker
        # leaving while this allgather waits would end the job instead.
        gathered = hvd.allgather(payload, name="HorovodAllgather_DGC_" + _op_name(name),
                                 process_set=process_set)
        # The 1-element placeholder for Horovod's allreduce is this rank's entry count (word 2 of
        # the payload), not a constant: TensorFlow's graph optimizer folds a collective whose
        # input is constant, which would run it once instead of every step.
        placeholder = tf.cast(payload[2:3], tensor.dtype)
        return placeholder, ((name, average, gathered), tensor, name, var)

    def _clip_scale(self, grads, tensor, process_set, average):
        """Trace-time: the step's clipping factor (``DGCCore.clip_scale`` over all the gradients
        Horovod reduces, in their order: one py_function per traced step, shared by every
        tensor), or a constant 1 when global clipping is off."""
        core = self._core
        if not core.needs_clip_scale:
            return tf.constant(1.0)
        graph = getattr(tensor, "graph", None)
        if self._scale is not None and self._scale[0] is grads and self._scale[1] is graph:
            return self._scale[2]
        dense = [g.values if isinstance(g, tf.IndexedSlices) else g
                 for g in grads if g is not None]

        def run_scale(*gs):
            self._follow_horovod()
            return tf.constant(core.clip_scale(list(gs), process_set.size(), average),
                                tf.float32)

        # in the graph the gradients live in, not in the tf.cond branch Horovod traces each
        # tensor's reduction in: every branch then captures the same one op
        with graph.as_default() if graph is not None else _nullcontext():
            scale = tf.py_function(run_scale, dense, tf.float32)
        self._scale = (grads, graph, scale)
        return scale

    @tf.autograph.experimental.do_not_convert
    def decompress(self, tensor, ctx):
        """Trace-time: decode the allgathered payloads (dense update), or pass a dense result;
        with ``weight_decay_mode="separate"`` the weight decay term is added to either."""
        info, original, name, var = ctx
        core, pending = self._core, self._pending
        separate_wd = core.separate_weight_decay
        if info is None:
            if not separate_wd:
                return tensor

            def run_wd(update, param):
                flat = tf.Variable(tf.reshape(tf.cast(update, tf.float32), [-1]))
                return tf.convert_to_tensor(core.apply_weight_decay(name, flat, param))

            dense = tf.py_function(run_wd, [tensor, var], tf.float32)
            return tf.cast(tf.reshape(dense, original.shape), original.dtype)
        _, average, gathered = info

        def run_decompress(g, _placeholder, param):
            ctx, words, world = pending.pop(name)
            core.count_allgather(core.B.numel(g), words)
            out = core.decompress(g, ctx, world, average)
            if separate_wd:
                out = core.apply_weight_decay(name, out, param)
            return tf.convert_to_tensor(out)

        param = var if separate_wd else tf.zeros([0])
        dense = tf.py_function(run_decompress, [gathered, tensor, param], tf.float32)
        return tf.cast(tf.reshape(dense, original.shape), original.dtype)


def _op_name(name):
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name)


#: Horovod-style namespace of compressors: ``Compression.dgc(**kwargs)`` makes a new :class:`DGC`.
Compression = compression_namespace(hvd, DGC, user="tape or optimizer", usage=(
    "tape = hvd.DistributedGradientTape(tape, compression=compression)"))

__all__ += ["Compression", "DGCTensorBoardCallback"]
