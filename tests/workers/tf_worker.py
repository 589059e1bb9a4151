"""Runs under `horovodrun -np 2`: DGC with stock horovod.tensorflow (tape and tf-keras).

Rank 0 writes what each scenario observed as JSON to --out; tests/test_tf_horovod.py asserts.
Needs TF_USE_LEGACY_KERAS=1 (tf-keras), set by the test.
"""
import argparse
import json
import warnings

import horovod.tensorflow as hvd
import horovod.tensorflow.keras as hvd_keras
import numpy as np
import tensorflow as tf

from dgc_horovod.tensorflow import DGC, DGCWarmupCallback
from timeline_flush import flush_timeline

LR = 0.05


def make_model(seed=1234, embedding=False, names=("fc1", "fc2"), hidden=128):
    tf.keras.utils.set_random_seed(seed)
    if embedding:
        inp = tf.keras.Input(shape=(4,), dtype="int32")
        h = tf.keras.layers.Flatten()(tf.keras.layers.Embedding(300, 8, name="emb")(inp))
    else:
        inp = tf.keras.Input(shape=(64,))
        h = inp
    h = tf.keras.layers.Dense(hidden, activation="relu", name=names[0])(h)
    out = tf.keras.layers.Dense(10, name=names[1])(h)
    return tf.keras.Model(inp, out)


def batches(steps, seed, embedding=False):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        x = (rng.integers(0, 300, (16, 4)).astype("int32") if embedding
             else rng.standard_normal((16, 64)).astype("float32"))
        out.append((x, rng.integers(0, 10, 16)))
    return out


def flat(model):
    return tf.concat([tf.reshape(v, [-1]) for v in model.variables], 0)


def identical(model):
    g = hvd.allgather(flat(model)[None], name="check_params")
    return bool(tf.reduce_all(g == g[0]))


def train_tape(model, compression, steps=20, momentum=0.0, nesterov=False, function=True,
               sparse_as_dense=False, nan_at=None, embedding=False, seed=None):
    opt = tf.keras.optimizers.SGD(LR, momentum=momentum, nesterov=nesterov)
    hvd.broadcast_variables(model.variables, root_rank=0)
    skipped = []

    def grads_of(x, y, scale):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
                y, model(x), from_logits=True)) * scale
        tape = hvd.DistributedGradientTape(tape, compression=compression,
                                           sparse_as_dense=sparse_as_dense)
        return tape.gradient(loss, model.trainable_variables)

    step_fn = tf.function(grads_of) if function else grads_of
    data = batches(steps, 100 + hvd.rank() if seed is None else seed, embedding)
    for i, (x, y) in enumerate(data):
        scale = tf.constant(float("nan") if (i == nan_at and hvd.rank() == 1) else 1.0)
        grads = step_fn(x, y, scale)
        bad = any(not bool(tf.reduce_all(tf.math.is_finite(tf.convert_to_tensor(g))))
                  for g in grads)
        skipped.append(bad)
        if not bad:
            opt.apply_gradients(zip(grads, model.trainable_variables))
    return skipped


def states_info(dgc):
    return {"states": sorted(dgc.states), "sparse": sorted(n for n, s in dgc.states.items()
                                                            if s.sparse)}


def scenario_identical(results):
    out = {}
    # the in-graph default (eager: Horovod traces its reduction anyway), and in_graph=False on
    # the C kernels (host) and on eager TensorFlow ops (tf_ops: what a GPU machine would run)
    paths = {"function_host": dict(in_graph=False),
             "function_tf_ops": dict(in_graph=False, device="gpu")}
    for mode in ("eager", "function", "function_host", "function_tf_ops"):
        dgc = DGC(compress_ratio=0.01, momentum=0.9, warmup_epochs=0, min_sparse_numel=1024,
                  **paths.get(mode, {}))
        model = make_model()
        before = flat(model).numpy()
        train_tape(model, dgc, function=mode.startswith("function"))
        out[mode] = dict(identical=identical(model),
                         changed=bool((flat(model).numpy() != before).any()),
                         steps=dgc.total_stats.steps, **states_info(dgc))
    results["identical"] = out


def scenario_equivalence(results):
    out = {}
    cases = {"momentum_correction": (dict(momentum_masking=False), dict(momentum=0.9)),
             "nesterov": (dict(momentum_masking=False, nesterov=True),
                          dict(momentum=0.9, nesterov=True)),
             "masking_equals_plain_sgd": (dict(momentum_masking=True), dict(momentum=0.0)),
             "momentum_correction_host": (dict(momentum_masking=False, in_graph=False),
                                          dict(momentum=0.9)),
             "momentum_correction_tf_ops": (dict(momentum_masking=False, in_graph=False,
                                                 device="gpu"), dict(momentum=0.9))}
    for name, (dgc_kw, sgd_kw) in cases.items():
        dgc = DGC(compress_ratio=1.0, momentum=0.9, warmup_epochs=0, min_sparse_numel=1,
                  min_sparse_ndim=1, **dgc_kw)
        m_dgc, m_ref = make_model(), make_model()
        train_tape(m_dgc, dgc, steps=8)
        train_tape(m_ref, hvd.Compression.none, steps=8, **sgd_kw)
        out[name] = float(tf.reduce_max(tf.abs(flat(m_dgc) - flat(m_ref))))
    results["equivalence"] = out


def scenario_wire(results, key="wire", **kw):
    dgc = DGC(compress_ratio=0.01, momentum=0.9, warmup_epochs=0, min_sparse_numel=1024, **kw)
    model = make_model()
    train_tape(model, dgc, steps=5)
    st = dgc.total_stats
    per_rank = hvd.allgather_object({"wire_bytes": st.wire_bytes, "dense_bytes": st.dense_bytes,
                                     "received_bytes": st.received_bytes, "steps": st.steps,
                                     "last_step": [dgc.stats.wire_bytes,
                                                   dgc.stats.received_bytes]})
    results[key] = {"per_rank": per_rank,
                     "numel": {n: s.numel for n, s in dgc.states.items()},
                     **states_info(dgc)}


def scenario_wire_host(results):
    scenario_wire(results, "wire_host", in_graph=False)


def scenario_wire_per_tensor(results):
    scenario_wire(results, "wire_per_tensor", bucket_numel=0)


def scenario_buckets(results):
    """One allgather per bucket (the default bucket_numel, one bucket here; and bucket_numel
    cutting this model in two) against one allgather per tensor (bucket_numel=0): the same
    parameters and DGC states, bit for bit, also through a step where rank 1's gradient is NaN
    and, with Nesterov and separate weight decay, through the other arithmetic (the tape in a
    tf.function; keras_fit runs the Keras optimizer with the default buckets)."""
    out = {}
    for case, kw in {"default": {}, "nesterov_wd": dict(nesterov=True, weight_decay=1e-3)}.items():
        runs = {}
        for bucket_numel in (0, 2 ** 22, 5000):
            dgc = DGC(compress_ratio=0.01, momentum=0.9, warmup_epochs=0, min_sparse_numel=1024,
                      bucket_numel=bucket_numel, **kw)
            model = make_model()
            skipped = train_tape(model, dgc, steps=8, nan_at=3)
            st = dgc.total_stats
            runs[bucket_numel] = dict(
                params=flat(model).numpy(), skipped=skipped, identical=identical(model),
                states={n: [None if t is None else np.asarray(t).tolist()
                            for t in (s.u, s.v, s.wd)] for n, s in dgc.states.items()},
                wire=st.wire_bytes, received=st.received_bytes, selected=st.selected)
        base = runs[0]
        out[case] = {str(b): dict(same_params=bool(np.array_equal(r["params"].view(np.int32),
                                                                   base["params"].view(np.int32))),
                                  same_states=r["states"] == base["states"],
                                  skipped=r["skipped"], identical=r["identical"],
                                  wire=r["wire"], received=r["received"],
                                  selected=r["selected"]) for b, r in runs.items()}
    results["buckets"] = out


def scenario_indexed_slices(results):
    out = {}
    for sad in (False, True):
        dgc = DGC(compress_ratio=0.05, momentum=0.9, warmup_epochs=0, min_sparse_numel=1024)
        model = make_model(embedding=True)
        train_tape(model, dgc, steps=6, sparse_as_dense=sad, embedding=True)
        out[str(sad)] = dict(identical=identical(model), **states_info(dgc))
    results["indexed_slices"] = out


def scenario_nonfinite(results):
    dgc = DGC(compress_ratio=0.01, momentum=0.9, warmup_epochs=0, min_sparse_numel=1024)
    model = make_model()
    skipped = train_tape(model, dgc, steps=8, nan_at=3)
    finite = all(bool(tf.reduce_all(tf.math.is_finite(t))) for s in dgc.states.values()
                 for t in (s.u, s.v) if t is not None)
    results["nonfinite"] = {"skipped": skipped, "states_finite": finite,
                            "identical": identical(model)}


def scenario_fp16_overflow(results, steps=12):
    """wire_values="float16" with tf-keras's LossScaleOptimizer at a loss scale too large for
    float16 (2**24): DGC's overflowing values must make it skip the step and back off."""
    dgc = DGC(compress_ratio=0.01, momentum=0.9, warmup_epochs=0, min_sparse_numel=1024,
              wire_values="float16")
    model = make_model()
    hvd.broadcast_variables(model.variables, root_rank=0)
    opt = tf.keras.mixed_precision.LossScaleOptimizer(tf.keras.optimizers.SGD(LR),
                                                      initial_scale=2.0 ** 24)

    @tf.function
    def grads_of(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
                y, model(x), from_logits=True))
            scaled = opt.get_scaled_loss(loss)
        tape = hvd.DistributedGradientTape(tape, compression=dgc)
        return opt.get_unscaled_gradients(tape.gradient(scaled, model.trainable_variables))

    scales, stepped, overflowed = [], [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in batches(steps, 300 + hvd.rank()):
            grads = grads_of(x, y)
            before = flat(model).numpy()
            opt.apply_gradients(zip(grads, model.trainable_variables))
            stepped.append(bool((flat(model).numpy() != before).any()))
            scales.append(float(opt.loss_scale))
            overflowed.append(dgc.stats.overflowed_entries)
    finite = all(bool(tf.reduce_all(tf.math.is_finite(t))) for s in dgc.states.values()
                 for t in (s.u, s.v) if t is not None)
    every = hvd.allgather_object({
        "scales": scales, "stepped": stepped, "overflowed": overflowed, "states_finite": finite,
        "warnings": [str(w.message) for w in caught if "float16" in str(w.message)]})
    results["fp16_overflow"] = {"ranks": every, "identical": identical(model),
                                "params_finite": bool(tf.reduce_all(tf.math.is_finite(
                                    flat(model))))}


def scenario_checkpoint_misfit(results):
    """A DGC state saved under the layer names fc1/fc2, loaded for a model whose layers are
    named head1/head2: refused at the first step, reset_residuals=True is the way out (on a new
    DGC, and on the refused one with the same model). Loaded for a model whose hidden layer is
    narrower (same names): refused, naming every resized tensor, in the graph and in
    tf.py_function (in_graph=False)."""
    dgc = DGC(compress_ratio=0.01, momentum=0.9, warmup_epochs=0, min_sparse_numel=1024)
    train_tape(make_model(), dgc, steps=2)
    sd = dgc.state_dict()
    out = {}
    for reset in (False, True):
        dgc = DGC(compress_ratio=0.01, momentum=0.9, warmup_epochs=0, min_sparse_numel=1024)
        dgc.load_state_dict(sd, reset_residuals=reset)
        model = make_model(names=("head1", "head2"))
        before = flat(model).numpy()
        try:
            train_tape(model, dgc, steps=2)
            out[f"error_{reset}"] = None
        except Exception as e:          # raised in a py_function: a tf.errors.* carrying it
            out[f"error_{reset}"] = str(e)
        out[f"changed_{reset}"] = bool((flat(model).numpy() != before).any())
        out[f"saved_{reset}"] = sorted(dgc.state_dict()["tensors"])
        if not reset:       # the way out on the same DGC and model, after the refusal
            dgc.load_state_dict(sd, reset_residuals=True)
            train_tape(model, dgc, steps=2)
            out["same_objects_changed"] = bool((flat(model).numpy() != before).any())
            out["same_objects_saved"] = sorted(dgc.state_dict()["tensors"])
    for in_graph in (True, False):
        dgc = DGC(compress_ratio=0.01, momentum=0.9, warmup_epochs=0, min_sparse_numel=1024,
                  in_graph=in_graph)
        dgc.load_state_dict(sd)
        try:
            train_tape(make_model(hidden=96), dgc, steps=1)
            out[f"resized_error_{in_graph}"] = None
        except Exception as e:
            out[f"resized_error_{in_graph}"] = str(e)
    results["checkpoint_misfit"] = out


def train_reference(model, steps, transform, momentum=0.0):
    """Dense reference: each rank's gradients go through ``transform(grads, variables)`` (the
    paper's local rule, transcribed), then Horovod's dense average, then SGD."""
    opt = tf.keras.optimizers.SGD(LR, momentum=momentum)
    hvd.broadcast_variables(model.variables, root_rank=0)
    for i, (x, y) in enumerate(batches(steps, 100 + hvd.rank())):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
                y, model(x), from_logits=True))
        grads = tape.gradient(loss, model.trainable_variables)
        grads = transform(grads, model.trainable_variables)
        grads = [hvd.allreduce(g, name=f"ref.{j}") for j, g in enumerate(grads)]
        opt.apply_gradients(zip(grads, model.trainable_variables))


def scenario_semantics(results):
    """Global local clipping (threshold C·√N under Average, one factor over all of a rank's
    gradients) and separate weight decay, at density 1, against dense transcriptions."""
    out, C, n = {}, 0.3, hvd.size()

    def clip_global(grads, variables):
        norm = float(tf.linalg.global_norm(grads))
        s = min(1.0, C * n ** 0.5 / (norm + 1e-6))
        return [g * s for g in grads]

    scales = []

    def clip_spy(grads, variables):
        norm = float(tf.linalg.global_norm(grads))
        scales.append(min(1.0, C * n ** 0.5 / (norm + 1e-6)))
        return clip_global(grads, variables)

    dgc = DGC(compress_ratio=1.0, momentum=0.0, momentum_masking=False, clip_norm=C,
              warmup_steps=0, min_sparse_ndim=1)
    m_dgc, m_ref = make_model(), make_model()
    train_tape(m_dgc, dgc, steps=8)
    train_reference(m_ref, 8, clip_spy)
    out["clip_global"] = float(tf.reduce_max(tf.abs(flat(m_dgc) - flat(m_ref))))
    out["clipped_steps"] = sum(s < 1 for s in scales)
    wd, m = 0.01, 0.9
    dgc = DGC(compress_ratio=1.0, momentum=m, momentum_masking=False, weight_decay=wd,
              warmup_steps=0)
    m_dgc, m_ref = make_model(), make_model()
    train_tape(m_dgc, dgc, steps=8)
    train_reference(m_ref, 8, lambda gs, vs: [g + wd * v for g, v in zip(gs, vs)], momentum=m)
    out["weight_decay_separate"] = float(tf.reduce_max(tf.abs(flat(m_dgc) - flat(m_ref))))
    out["sparse"] = states_info(dgc)["sparse"]
    out["wd_buffers"] = sorted(k for k, s in dgc.states.items() if s.wd is not None)
    results["semantics"] = out


def scenario_keras_fit(results):
    dgc = DGC(compress_ratio=0.01, momentum=0.9, warmup_epochs=2, min_sparse_numel=1024)
    model = make_model()
    opt = hvd_keras.DistributedOptimizer(tf.keras.optimizers.SGD(LR), compression=dgc)
    model.compile(optimizer=opt, loss=tf.keras.losses.SparseCategoricalCrossentropy(True))
    rng = np.random.default_rng(100 + hvd.rank())
    x, y = rng.standard_normal((128, 64)).astype("float32"), rng.integers(0, 10, 128)
    hist = model.fit(x, y, batch_size=16, epochs=3, verbose=0,
                     callbacks=[hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0),
                                DGCWarmupCallback(dgc)])
    results["keras_fit"] = dict(identical=identical(model), density=hist.history["dgc_density"],
                                ratio=hist.history["dgc_ratio"], steps=dgc.total_stats.steps,
                                **states_info(dgc))


def scenario_keras_momentum_twice(results):
    """Momentum in DGC and in the Keras optimizer: refused at the first step; also for the
    legacy optimizers (their momentum a tf.Variable), which train with momentum=0."""
    for key, sgd in (("", tf.keras.optimizers.SGD), ("_legacy", tf.keras.optimizers.legacy.SGD)):
        for momentum in (0.9, 0.0):
            model = make_model()
            opt = hvd_keras.DistributedOptimizer(sgd(LR, momentum=momentum),
                                                 compression=DGC(compress_ratio=0.01,
                                                                 momentum=0.9))
            model.compile(optimizer=opt,
                          loss=tf.keras.losses.SparseCategoricalCrossentropy(True))
            x, y = np.zeros((16, 64), "float32"), np.zeros(16, "int64")
            try:
                model.fit(x, y, batch_size=16, epochs=1, verbose=0)
                error = None
            except ValueError as e:
                error = str(e)
            results[f"keras_momentum{key}_{momentum}"] = error


def fit_warnings(optimizer, dgc, marker):
    """The warnings (texts containing ``marker``) of a Keras fit of two steps."""
    model = make_model()
    opt = hvd_keras.DistributedOptimizer(optimizer, compression=dgc)
    model.compile(optimizer=opt, loss=tf.keras.losses.SparseCategoricalCrossentropy(True))
    x, y = np.zeros((32, 64), "float32"), np.zeros(32, "int64")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    return [str(w.message) for w in caught if marker in str(w.message)]


def scenario_keras_weight_decay_twice(results):
    """Weight decay in DGC and in the Keras optimizer: one warning (and training goes on); in
    DGC only: none. Adam with DGC's momentum: one warning; with DGC(momentum=0): none."""
    results["keras_weight_decay_twice"] = {str(decay): fit_warnings(
        tf.keras.optimizers.SGD(LR, weight_decay=decay), DGC(weight_decay=1e-4),
        "applied twice") for decay in (1e-4, None)}
    results["keras_adam_warning"] = {str(momentum): fit_warnings(
        tf.keras.optimizers.Adam(1e-3), DGC(momentum=momentum), "moment estimates")
        for momentum in (0.9, 0.0)}


def scenario_made_in_trace(results, steps=6):
    """Horovod's tensorflow2_mnist.py with one line changed: the compressor chosen inside the
    traced step (refused at the first step, with the fix), and the fix: one DGC made outside
    the step, which the example traces twice (its first_batch flag is a Python bool); then the
    same under tf.config.run_functions_eagerly(True) (refused with in_graph=True, trains with
    in_graph=False)."""
    out = {}
    for where in ("inside", "outside", "eagerly", "eagerly_host"):
        model = make_model()
        opt = tf.keras.optimizers.SGD(LR)
        dgc = None if where == "inside" else DGC(compress_ratio=0.01, min_sparse_numel=1024,
                                                  in_graph=where != "eagerly_host")
        tf.config.run_functions_eagerly(where.startswith("eagerly"))    # the debugging switch

        @tf.function
        def training_step(x, y, first_batch):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
                    y, model(x, training=True), from_logits=True))
            compression = dgc if dgc is not None else DGC(compress_ratio=0.01)
            tape = hvd.DistributedGradientTape(tape, compression=compression)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            if first_batch:                   # as the example: after the first step
                hvd.broadcast_variables(model.variables, root_rank=0)
                hvd.broadcast_variables(opt.variables(), root_rank=0)
            return loss

        before = flat(model).numpy()
        done, error = 0, None
        try:
            for i, (x, y) in enumerate(batches(steps, 300 + hvd.rank())):
                training_step(tf.constant(x), tf.constant(y), i == 0)
                done += 1
        except RuntimeError as e:
            error = str(e)
        tf.config.run_functions_eagerly(False)
        out[where] = dict(error=error, done=done, identical=identical(model),
                          changed=bool((flat(model).numpy() != before).any()),
                          traces=training_step.experimental_get_tracing_count())
        if dgc is not None:
            out[where].update(steps=dgc.total_stats.steps, **states_info(dgc))
    results["made_in_trace"] = out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--scenarios", default="identical,equivalence,indexed_slices,nonfinite,"
                    "keras_fit,keras_momentum_twice,keras_weight_decay_twice,semantics,"
                    "fp16_overflow,checkpoint_misfit,"
                    "buckets,made_in_trace",
                    help="comma-separated scenario names")
    args = ap.parse_args()
    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    results = {"size": hvd.size()}
    for name in args.scenarios.split(","):
        globals()["scenario_" + name](results)
    # traced: an eager op's name does not reach Horovod's timeline
    marker = tf.function(lambda v: hvd.allreduce(v, name="timeline_flush_marker", op=hvd.Sum))
    flush_timeline(hvd.rank(), lambda name, value: float(marker(tf.constant([value]))[0]))
    if hvd.rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
