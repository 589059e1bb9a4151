"""Which backend the TensorFlow adapter's core runs on, and the conversions at its edge.

DGC's per-step work runs eagerly inside the ``tf.py_function`` ops that
:class:`dgc_horovod.tensorflow.DGC` places in the traced step. Where TensorFlow sees no GPU, the
gradients given to those ops are host tensors, so the core runs on the NumPy backend and so on the
C engine (:mod:`dgc_horovod.core.c_engine`): one call per tensor for accumulate → select →
encode, one for decode → sum → average, as PyTorch on a CPU does with ``bucket_numel=0``. Eager TensorFlow ops (the
tensor-op path, :class:`~dgc_horovod.backends.tf_backend.TFBackend`) cost dozens of op dispatches
per tensor per step: ``examples/tensorflow2_mnist.py`` ran 4.9× the wall time of dense training
on them (docs/performance.md). Where TensorFlow sees a GPU, the core stays on ``TFBackend``, so
gradients are not copied to the host.

On the NumPy backend the state (u, v, the weight-decay momentum) is held in NumPy arrays, and
:meth:`DGC.state_dict` returns NumPy arrays (picklable as they are).
"""
import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from dgc_horovod.backends.tf_backend import TFBackend
from dgc_horovod.core.backend import NumpyBackend
from dgc_horovod.core.sparsify import is_sparse
from dgc_horovod.tensorflow.clipping import StepClipScale
from dgc_horovod.tensorflow.variables import collective_name

__all__ = ["make_backend", "Host", "HostPath", "check_traced"]


def make_backend(device=None):
    """NumpyBackend (the C kernels) when TensorFlow sees no GPU, else TFBackend.

    device: "cpu" or "gpu" to force the choice (tests); None: decide from
    ``tf.config.list_logical_devices("GPU")``."""
    if device is None:
        device = "gpu" if tf.config.list_logical_devices("GPU") else "cpu"
    if device not in ("cpu", "gpu"):
        raise ValueError(f"DGC: device must be 'cpu', 'gpu' or None, got {device!r}")
    return NumpyBackend() if device == "cpu" else TFBackend()


def check_traced(tensor):
    """The checks of a gradient handed to ``DGC.compress`` that need nothing else: a TypeError
    for a non-floating gradient; a RuntimeError that says what to change when the reduction is
    traced for XLA (``tf.function(jit_compile=True)``): DGC's ops cannot be compiled by XLA
    (Horovod's allgather has no XLA kernel, the selection's shapes depend on the data, and
    ``in_graph=False`` runs ``tf.py_function``), and TensorFlow's own error names neither DGC
    nor the fix."""
    if not tensor.dtype.is_floating:
        raise TypeError(f"DGC: gradients must be floating-point tensors, got {tensor.dtype}")
    try:
        from tensorflow.python.ops.control_flow_util import GraphOrParentsInXlaContext
    except ImportError:         # a TensorFlow without this helper: its own error remains
        return
    if GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
        raise RuntimeError(
            "DGC cannot run under tf.function(jit_compile=True): XLA cannot compile its ops "
            "(Horovod's allgather has no XLA kernel, and the number of entries selected depends "
            "on the data). Drop jit_compile=True from the function that calls the "
            "DistributedGradientTape's gradient() (or Keras' model.compile(jit_compile=...))")


class Host:
    """The conversions between TensorFlow's tensors and the core's backend B."""

    def __init__(self, B):
        self.B = B
        self.numpy = isinstance(B, NumpyBackend)

    def dtype(self, tensor):
        """The dtype to hand ``tensor`` to the core in: float32 for the NumPy backend (what the
        core computes in anyway; NumPy has no bfloat16), its own dtype otherwise."""
        return tf.float32 if self.numpy else tensor.dtype

    def __call__(self, t):
        """An eager tensor as the core's tensor: on the NumPy backend a read-only NumPy view of
        its memory (no copy; the core only reads gradients and received payloads). What the core
        returns to ``tf.py_function`` is copied by TensorFlow into a new tensor."""
        return np.asarray(t) if self.numpy else t

    def portable(self, state_dict):
        """``state_dict`` as this backend loads it: tensors as NumPy arrays on the NumPy
        backend."""
        if not isinstance(state_dict, dict):
            return state_dict
        tensors = state_dict.get("tensors")
        if self.numpy and isinstance(tensors, dict):      # tf.Tensors -> NumPy arrays
            state_dict = dict(state_dict, tensors={
                name: {k: (np.asarray(t) if k in ("u", "v", "wd") and t is not None else t)
                       for k, t in entry.items()} if isinstance(entry, dict) else entry
                for name, entry in tensors.items()})
        return state_dict


class HostPath:
    """``DGC(in_graph=False)``: the per-step work of each tensor in two ``tf.py_function`` ops
    placed in the traced step (compress, decompress), which run the core eagerly on its backend
    (the C kernels without a GPU). Made by the adapter, which hands it each gradient once it has
    located its variable and checked it."""

    def __init__(self, dgc):
        self.core, self.host = dgc._core, Host(dgc._core.B)
        self._dgc = dgc
        self.pending = {}      # between compress and decompress: name -> (ctx, words, world)
        self._clip_scale = StepClipScale(self.core, dgc._follow_horovod, self.host)

    def compress(self, tensor, var, name, reduced, process_set, average):
        """Trace-time: place the ops for ``tensor`` in the graph; return (to allreduce, ctx)."""
        core, pending, host, variables = self.core, self.pending, self.host, reduced[1]
        names = self._dgc._names
        sparse = is_sparse(tensor.shape.num_elements(), len(tensor.shape), core.config)
        scale = self._clip_scale(reduced[0], tensor, process_set, average)

        def run_compress(grad, param, clip_scale):
            # The world size is read when the step runs, not when it was traced: an elastic
            # reset changes it without retracing (Keras keeps its train function).
            self._dgc._follow_horovod()
            now = process_set.size()
            if core.fit_pending:                    # the first step after load_state_dict:
                core.check_fit(names.sizes(variables))      # every variable reduced
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

    def decompress(self, tensor, ctx):
        """Trace-time: decode the allgathered payloads (dense update), or pass a dense result;
        with ``weight_decay_mode="separate"`` the weight decay term is added to either."""
        info, original, name, var = ctx
        core, pending, host = self.core, self.pending, self.host
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
