"""Which variable is this? How :class:`dgc_horovod.tensorflow.DGC` finds the variable a gradient
belongs to, and names its state.

Horovod's ``allreduce_grads(grads, vars)`` (built by ``_make_allreduce_grads_fn`` for both the tape
and the Keras optimizer, and wrapped in a ``tf.function`` even in eager mode) calls
``compress(grad)`` while it traces, with the gradient only. :func:`find_variable` walks up the
Python stack at trace time to that ``allreduce_grads`` frame and finds the position j with
``grads[j] is tensor``; ``vars[j]`` is the variable. Tracing runs on every rank in the same order,
so each variable gets the same state key and collective name everywhere (:class:`StateNames`: its
``var.name``; a second distinct variable with the same name gets ``name#2``, never a shared
state; :func:`collective_name` makes the name of its allgather). :class:`ComparedModels` has the
ranks compare the variables Horovod reduces, once per list of variables.
"""
import json
import sys

import horovod.tensorflow as hvd
import tensorflow as tf

from dgc_horovod.adapter import check_same_model

__all__ = ["find_variable", "StateNames", "collective_name", "ComparedModels"]

_HINT = ("pass it as compression= to horovod.tensorflow.DistributedGradientTape or to "
         "horovod.tensorflow.keras.DistributedOptimizer; DGC keeps per-variable state and must know "
         "which variable a gradient belongs to")
_MAX_FRAMES = 80
# Horovod's reduction function, as written and as converted by AutoGraph inside tf.function.
_REDUCE_FRAMES = ("allreduce_grads", "tf__allreduce_grads")


@tf.autograph.experimental.do_not_convert
def find_variable(tensor):
    """(variable, op, process_set, owner, (grads, vars)) of the Horovod reduction that is
    compressing ``tensor``; (grads, vars) are the lists that reduction was given. Call it from
    ``DGC.compress`` itself (it reads the caller's caller's frames)."""
    frame = sys._getframe(2)
    op = process_set = found = reduced = None
    for _ in range(_MAX_FRAMES):
        if frame is None:
            break
        local = frame.f_locals
        if op is None and "process_set" in local and "op" in local:
            op, process_set = local["op"], local["process_set"]
        if found is None and frame.f_code.co_name in _REDUCE_FRAMES and "grads" in local \
                and "vars" in local:
            grads, variables = local["grads"], local["vars"]
            if variables is None:
                raise RuntimeError("Horovod reduced these gradients without their variables; "
                                   + _HINT)
            for j, g in enumerate(grads):
                if g is tensor:
                    found, reduced = variables[j], (grads, variables)
                    break
            else:
                raise RuntimeError("DGC could not match the gradient it was given (shape "
                                   f"{tensor.shape}) to one of the {len(grads)} gradients "
                                   "Horovod is reducing")
        owner = local.get("self")
        if found is not None and owner is not None and hasattr(owner, "_allreduce_grads"):
            return found, op, process_set, owner, reduced   # the Horovod tape or optimizer
        frame = frame.f_back
    if found is not None:
        return found, op, process_set, None, reduced
    raise RuntimeError("dgc_horovod.tensorflow.DGC was called outside Horovod's gradient "
                       "reduction; " + _HINT)


def _model_signature(grads, variables):
    """[name, "shape [...], dtype"] of every variable Horovod reduces a gradient of, in its
    order."""
    return [[v.name, f"shape {v.shape.as_list()}, {v.dtype.name}"]
            for g, v in zip(grads, variables) if g is not None]


_MISMATCH = ("the gradient #{i} Horovod reduces is of {a} on rank {me} but of {b} on rank {rank}; "
             "every rank must reduce the same trainable variables in the same order",
             "rank {me} reduces the gradients of {n} variables, rank {rank} of {m}{detail} (a "
             "variable trainable or present on one rank only?)")


def _check_same_variables(signature, process_set, config):
    """:func:`dgc_horovod.adapter.check_same_model` for a :func:`_model_signature`, with two
    eager allgathers (``DGCCheckModelSizes``, ``DGCCheckModel``), also while a tf.function is
    traced."""
    def gather(data):
        with tf.init_scope():
            sizes = hvd.allgather(tf.constant([len(data)], tf.int32), name="DGCCheckModelSizes",
                                  process_set=process_set).numpy().tolist()
            every = hvd.allgather(tf.constant(list(data), tf.int32), name="DGCCheckModel",
                                  process_set=process_set).numpy().astype("uint8").tobytes()
        return sizes, every

    check_same_model(signature, gather, process_set.rank(), _MISMATCH, config)


class StateNames:
    """The state name of each variable: its ``var.name``, or ``name#2`` (``#3``, ...) for a second
    distinct variable with the same name. The variables are kept alive, so their ids stay
    unique."""

    def __init__(self):
        self._names = {}        # id(variable) -> (variable, state name)

    def of(self, var):
        """``var``'s state name (named now if it has none yet)."""
        key = id(var)
        if key not in self._names:
            base = var.name
            taken = {name for _, name in self._names.values()}
            name, n = base, 1
            while name in taken:
                n += 1
                name = f"{base}#{n}"
            self._names[key] = (var, name)
        return self._names[key][1]

    def known(self, variables):
        """The state names of ``variables`` (their names where DGC has not named them yet)."""
        return [self._names[id(v)][1] if id(v) in self._names else v.name for v in variables]

    def sizes(self, variables):
        """{state name: element count} of ``variables`` (:meth:`known`'s names), what
        :meth:`DGCCore.check_fit` compares a loaded checkpoint with."""
        return dict(zip(self.known(variables), (v.shape.num_elements() for v in variables)))


def collective_name(name):
    """The name of the allgather of state ``name``'s payload. "HorovodAllgather" in it:
    hvd.elastic.run (TensorFlow) recognizes a failed Horovod op by its op name in the error
    message and restores; without it a worker leaving while this allgather waits would end the
    job instead."""
    return "HorovodAllgather_DGC_" + "".join(c if c.isalnum() or c in "._-" else "_"
                                             for c in name)


class ComparedModels:
    """The lists of variables the ranks have compared (names, shapes, dtypes, order): each is
    compared once, while Horovod's reduction is traced, with one pair of eager allgathers."""

    def __init__(self):
        self._keys = set()      # the signatures already compared, as JSON

    def check(self, grads, variables, process_set, config):
        """ValueError, on every rank, naming the first difference between the ranks' lists or
        their DGC settings (``config``)."""
        signature = _model_signature(grads, variables)
        key = json.dumps(signature)
        if key not in self._keys:
            _check_same_variables(signature, process_set, config)
            self._keys.add(key)

    def sync(self):
        """Collective (the elastic state's sync): every rank takes the union of the signatures
        the ranks have compared. The comparison runs, with collectives, while Horovod's
        reduction is traced; after a reset the survivors do not trace again (Keras keeps its
        train function), so a joining worker, which traces alone, must skip the collectives for
        a model the others already compared. (A joining worker whose model differs from every
        compared one starts the comparison alone and waits: Horovod's stall warnings then name
        DGCCheckModelSizes.)"""
        every = hvd.allgather_object(sorted(self._keys), name="dgc.elastic.models")
        self._keys = set().union(*every)
