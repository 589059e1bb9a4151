"""Global clipping in TensorFlow (``clip_norm`` with ``clip_scope="global"``): the clipping factor
of a traced step, over all the gradients Horovod reduces, as one op that every tensor's
compression reads.
"""
from contextlib import nullcontext

import tensorflow as tf

__all__ = ["StepClipScale"]


class StepClipScale:
    """Trace-time: ``scale(grads, tensor, process_set, average)`` is the step's clipping factor
    (``DGCCore.clip_scale`` over all of ``grads``, in their order: one py_function per traced
    step, shared by every tensor), or a constant 1 when global clipping is off.

    Args:
        core (DGCCore): the compressor's core.
        follow_horovod: called before the factor is computed, when the step runs (the adapter's
            elastic reset rule).
    """

    def __init__(self, core, follow_horovod, host):
        self._core, self._follow_horovod, self._host = core, follow_horovod, host
        self._last = None       # (grads list, graph, clip factor tensor) of the traced step

    def __call__(self, grads, tensor, process_set, average):
        core = self._core
        if not core.needs_clip_scale:
            return tf.constant(1.0)
        graph = getattr(tensor, "graph", None)
        if self._last is not None and self._last[0] is grads and self._last[1] is graph:
            return self._last[2]
        dense = [g.values if isinstance(g, tf.IndexedSlices) else g
                 for g in grads if g is not None]
        dense = [tf.cast(g, self._host.dtype(g)) for g in dense]

        def run_scale(*gs):
            self._follow_horovod()
            scale = core.clip_scale([self._host(g) for g in gs], process_set.size(), average)
            return tf.constant(scale, tf.float32)

        # in the graph the gradients live in, not in the tf.cond branch Horovod traces each
        # tensor's reduction in: every branch then captures the same one op
        with graph.as_default() if graph is not None else nullcontext():
            scale = tf.py_function(run_scale, dense, tf.float32)
        self._last = (grads, graph, scale)
        return scale
