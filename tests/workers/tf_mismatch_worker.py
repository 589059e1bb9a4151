"""Runs under `horovodrun -np 2`: TF ranks whose models differ get a clear error, never a hang.

Each scenario builds a model (or DGC: "config") that differs on rank 1 (or the same model, as
the control), takes one step with hvd.DistributedGradientTape(compression=DGC(...)) inside
tf.function (or eagerly, or Keras fit with horovod.tensorflow.keras.DistributedOptimizer), and
records the error type and message and the seconds it took. Every rank writes
DIR/rank<r>.json; tests/test_tf_mismatch.py asserts. Needs TF_USE_LEGACY_KERAS=1 (tf-keras),
set by the test.
"""
import argparse
import json
import os
import time

import horovod.tensorflow as hvd
import horovod.tensorflow.keras as hvd_keras
import numpy as np
import tensorflow as tf

from dgc_horovod.tensorflow import DGC

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
args = parser.parse_args()
hvd.init()
R = hvd.rank()


def make_model(fc1_name="fc1", fc1_units=32, frozen_fc1=False):
    tf.keras.utils.set_random_seed(7)
    inp = tf.keras.Input(shape=(16,))
    h = tf.keras.layers.Dense(fc1_units, activation="relu", name=fc1_name)(inp)
    out = tf.keras.layers.Dense(4, name="fc2")(h)
    model = tf.keras.Model(inp, out)
    if frozen_fc1:
        model.get_layer(fc1_name).trainable = False
    return model


def data():
    rng = np.random.default_rng(R)
    return (rng.standard_normal((8, 16)).astype("float32"), rng.integers(0, 4, 8))


def tape_step(model, reverse=False, function=True, **dgc_kw):
    dgc = DGC(compress_ratio=0.1, warmup_epochs=0, **dgc_kw)
    x, y = data()
    variables = model.trainable_variables[::-1] if reverse else model.trainable_variables

    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
                y, model(x), from_logits=True))
        tape = hvd.DistributedGradientTape(tape, compression=dgc)
        return tape.gradient(loss, variables)

    grads = (tf.function(step) if function else step)()
    return [float(tf.reduce_sum(g)) for g in grads]


def keras_fit(model):
    dgc = DGC(compress_ratio=0.1, warmup_epochs=0)
    opt = hvd_keras.DistributedOptimizer(tf.keras.optimizers.SGD(0.05), compression=dgc)
    model.compile(opt, tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = data()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)


SCENARIOS = {
    "same": lambda: tape_step(make_model()),
    "names": lambda: tape_step(make_model(fc1_name="hidden" if R == 1 else "fc1")),
    "shapes": lambda: tape_step(make_model(fc1_units=48 if R == 1 else 32)),
    "order": lambda: tape_step(make_model(), reverse=R == 1),
    "trainable_on_one_rank": lambda: tape_step(make_model(frozen_fc1=R == 1)),
    "shapes_eager": lambda: tape_step(make_model(fc1_units=48 if R == 1 else 32),
                                      function=False),
    "keras_fit_shapes": lambda: keras_fit(make_model(fc1_units=48 if R == 1 else 32)),
    "config": lambda: tape_step(make_model(), **({"bucket_numel": 0} if R == 1 else {})),
    "same_after_errors": lambda: tape_step(make_model()),
}

results = {}
for name, scenario in SCENARIOS.items():
    t0 = time.perf_counter()
    try:
        scenario()
        error = None
    except Exception as e:          # noqa: BLE001 - the test checks the type and message
        error = {"type": type(e).__name__, "message": str(e)}
    results[name] = {"error": error, "seconds": time.perf_counter() - t0}
    print(f"rank {R} {name}: {error and error['type']} in {results[name]['seconds']:.2f} s",
          flush=True)

with open(os.path.join(args.out, f"rank{R}.json"), "w") as f:
    json.dump(results, f)
