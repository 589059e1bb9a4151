"""Runs under elastic `horovodrun` (Gloo): TensorFlow DGC with hvd.elastic.run and
dgc_horovod.tensorflow.elastic.TensorFlowKerasState; a worker leaves. The TensorFlow twin of
elastic_worker.py (same job, same records, same checks; tests/test_tf_elastic.py asserts).

    horovodrun -np 3 --min-np 2 --max-np 3 --host-discovery-script <script> --gloo \
        python tests/workers/tf_elastic_worker.py --out DIR [--mode exit|remove --hosts-file F]

The discovery script lists `localhost:2` and `127.0.0.1:1`. At step EXIT_STEP the worker on
127.0.0.1 calls os._exit(3) (`exit`: the others fail in a collective, restore the last commit and
re-initialize with 2 ranks) or rank 0 removes 127.0.0.1 from the discovery output (`remove`: the
commit raises HostsUpdatedInterrupt and Horovod skips sync).

The step is one tf.function (GradientTape + hvd.DistributedGradientTape(compression=dgc) +
apply_gradients), traced once in the world of 3 and kept across the reset, as Keras keeps its
train function: DGC must read the world size when the step runs.

What every process records (DIR/<host>.<local rank>.json, written when it finishes): restore
(one uncommitted step, state.restore(), DGC's state_dict and the variables bit-identical to the
commit), fresh (at the first step of every world: u = v = s·g off the sent positions and 0 on
them, s the local clipping factor of the current world size, not of the previous one), failed,
entries, config_mismatch (TensorFlowState(dgc=...).sync() with another compress_ratio on rank 1)
and final (variables finite and bit-identical on every rank), as elastic_worker.py describes; the
loop and the records are elastic_common.py's.
"""
import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import horovod.tensorflow as hvd               # noqa: E402
import numpy as np                             # noqa: E402
import tensorflow as tf                        # noqa: E402
from horovod.common.exceptions import HorovodInternalError  # noqa: E402

from dgc_horovod.tensorflow import DGC         # noqa: E402
from dgc_horovod.tensorflow import elastic as dgc_elastic   # noqa: E402
from elastic_common import DGC_KW, parse_args, run          # noqa: E402

args = parse_args()
hvd.init()
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(2)
tf.keras.utils.set_random_seed(0)
model = tf.keras.Sequential([tf.keras.layers.Dense(32, activation="relu", input_shape=(20,)),
                             tf.keras.layers.Dense(4)])
model.build((None, 20))
opt = tf.keras.optimizers.SGD(0.5)
opt.build(model.trainable_variables)
dgc = DGC(**DGC_KW)
state = dgc_elastic.TensorFlowKerasState(model, opt, dgc=dgc, step=0)
loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def batch(step):
    rng = np.random.default_rng(1000 * step + hvd.rank())
    return (rng.standard_normal((32, 20)).astype(np.float32),
            rng.integers(0, 4, 32).astype(np.int64))


@tf.function
def local_gradients(x, y):
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x))
    return tape.gradient(loss, model.trainable_variables)


@tf.function
def step_fn(x, y):
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x))
    tape = hvd.DistributedGradientTape(tape, compression=dgc)
    opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                            model.trainable_variables))


def train_step(step):
    """One step; returns this rank's local gradients (before the exchange) by variable name."""
    x, y = batch(step)
    local = {v.name: g.numpy().astype(np.float64).ravel()
             for v, g in zip(model.trainable_variables, local_gradients(x, y))}
    step_fn(x, y)
    return local


def dgc_arrays():
    return {name: (st.sparse, np.asarray(st.u, np.float64),
                   np.asarray(st.v, np.float64) if st.sparse else None)
            for name, st in dgc.states.items()}


def bits(t):
    return None if t is None else tf.bitcast(tf.convert_to_tensor(t, tf.float32), tf.int32).numpy()


def same_state(a, b):
    if set(a["tensors"]) != set(b["tensors"]):
        return False
    for name, t in a["tensors"].items():
        for key in ("u", "v"):
            x, y = bits(t[key]), bits(b["tensors"][name][key])
            if (x is None) != (y is None) or (x is not None and not np.array_equal(x, y)):
                return False
    return all(a[k] == b[k] for k in ("epoch", "steps", "total_stats", "step_stats"))


def restore_check(step):
    committed = dgc.state_dict()
    variables = [v.numpy().copy() for v in model.variables]
    train_step(step)                      # not committed
    moved = any(not np.array_equal(a, v.numpy()) for a, v in zip(variables, model.variables))
    state.restore()
    same = all(np.array_equal(a, v.numpy()) for a, v in zip(variables, model.variables))
    return {"moved": moved, "step_after": state.step,
            "identical_to_commit": same and same_state(committed, dgc.state_dict())}


def final_params():
    flat = tf.concat([tf.reshape(v, [-1]) for v in model.variables], 0)
    every = hvd.allgather(flat[None], name="elastic.final")
    return (flat.numpy().tolist(), bool(tf.reduce_all(tf.math.is_finite(flat))),
            bool(tf.reduce_all(every == every[0])))


# hvd.elastic.run turns a failed Horovod op (UnknownError) into HorovodInternalError outside;
# the config check runs through TensorFlowState (the job trains with TensorFlowKerasState)
run(hvd, args, state, dgc, train_step, restore_check, dgc_arrays, final_params,
    (HorovodInternalError, tf.errors.OpError),
    lambda other: dgc_elastic.TensorFlowState(model.variables, dgc=other))
