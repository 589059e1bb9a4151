"""Where DGC's extra wall time goes in TensorFlow: the example's ``train_step`` split into its
phases, dense (``hvd.Compression.none``) against DGC in the graph (the default), side by side.

Each variant runs under ``horovodrun -np 2 -H localhost:2 --gloo``: the model of
``examples/tf_model.py``, the example's traced step (``make_train_step`` of
``examples/tensorflow2_mnist.py``: ``hvd.DistributedGradientTape``, SGD; one intra-op thread,
two inter-op threads), 32 random digits per rank and step. Rank 0 prints

- ``trace``: ``train_step.get_concrete_function()`` (TensorFlow traces a step twice when its first
  run creates variables, DGC's and the optimizer's);
- ``first run``: the first step (TensorFlow optimises the graph and makes its kernels);
- ``warm-up``: steps 1 .. warmup-1 (DGC's density falls from 25% to the target);
- ``after``: the remaining steps; each with its sum and the median step;
- ``ops``: the traced step's graph ops, the bodies of its functions (branches, loops) included.

``--breakdown`` (DGC): where the trace's time goes on rank 0, inclusive seconds in the adapter's
trace-time calls: ``DGC.compress`` / ``DGC.decompress`` (everything DGC does while Horovod
traces), within them the model comparison across ranks (``ComparedModels.check``, collectives),
``GraphCore.step_ops``, ``GraphCore.plan_ops`` (the buckets: their members' compress, framing,
allgather and decode), ``GraphCore.compress_ops`` (one tensor's compress function, bucket members
included) and ``GraphCore.decompress_ops``; and how many calls.

``--no-grappler`` (a diagnosis, not a setting to train with): TensorFlow's graph optimiser
(Grappler) off in both variants, to split the first run into optimisation and the rest.

``--model`` MobileNetV2 / ResNet50 (any ``tf.keras.applications`` name) runs the same step on
that Keras application instead (``weights=None``, 10 classes, random ``--image`` x ``--image``
RGB images, ``--batch`` per rank), as Horovod's synthetic benchmark does.

    python benchmarks/tf_step_phases.py [--steps 630] [--warmup-steps 63]
    python benchmarks/tf_step_phases.py --model MobileNetV2 --steps 6 --warmup-steps 2 \
        [--image 64] [--batch 4] [--breakdown] [--no-grappler]
"""
import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _timed(owner, name, totals):
    """Wrap ``owner.name`` to add its inclusive seconds and calls to ``totals[label]``."""
    import functools
    fn = getattr(owner, name)
    label = f"{owner.__name__}.{name}"
    totals[label] = [0.0, 0]

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            totals[label][0] += time.perf_counter() - t0
            totals[label][1] += 1
    setattr(owner, name, wrapper)


def _inner(variant, steps, warmup, app=None, image=64, batch=4, breakdown=False,
           grappler=True):
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import numpy as np
    import tensorflow as tf
    import horovod.tensorflow as hvd
    from dgc_horovod.tensorflow import DGC
    from tensorflow2_mnist import make_train_step
    from tf_model import make_model
    from tf_graph_cost import graph_ops     # benchmarks/, this script's folder
    hvd.init()
    if not grappler:
        tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    tf.keras.utils.set_random_seed(1)
    totals = {}
    if breakdown and variant == "dgc":
        from dgc_horovod.tensorflow import graph, variables
        for owner, names in ((DGC, ("compress", "decompress")),
                             (variables.ComparedModels, ("check",)),
                             (graph.GraphCore, ("step_ops", "plan_ops", "compress_ops",
                                                "decompress_ops"))):
            for name in names:
                _timed(owner, name, totals)
    if app:
        model = getattr(tf.keras.applications, app)(weights=None, classes=10,
                                                     input_shape=(image, image, 3))
    else:
        model = make_model()
    if variant == "dgc":
        comp = DGC(momentum=0.9, warmup_steps=warmup)
        opt = tf.keras.optimizers.SGD(0.02, momentum=0.0)
    else:
        comp = hvd.Compression.none
        opt = tf.keras.optimizers.SGD(0.02, momentum=0.9)
    shape = (image, image, 3) if app else (28, 28, 1)
    bs = batch if app else 32
    train_step = make_train_step(model, opt, comp, shape)
    rng = np.random.default_rng(hvd.rank())
    x = rng.random((64 * bs,) + shape, dtype=np.float32)
    y = rng.integers(0, 10, 64 * bs)
    t0 = time.perf_counter()
    concrete = train_step.get_concrete_function()
    trace = time.perf_counter() - t0
    ops = graph_ops(concrete)
    ts = []
    for s in range(steps):
        b = slice(s % 64 * bs, s % 64 * bs + bs)
        t0 = time.perf_counter()
        float(train_step(x[b], y[b]))
        ts.append(time.perf_counter() - t0)
    if hvd.rank() == 0:
        w, a = ts[1:warmup], ts[max(warmup, 1):]
        med = lambda v: 1e3 * float(np.median(v)) if v else 0.0     # noqa: E731
        print(f"RESULT {variant:>5}: trace {trace:5.2f} s | first run {ts[0]:5.2f} s | warm-up "
              f"{sum(w):5.2f} s ({med(w):5.1f} ms/step) | after {sum(a):6.2f} s "
              f"({med(a):5.1f} ms/step) | total {trace + sum(ts):6.2f} s | ops {ops}", flush=True)
        for label, (sec, calls) in totals.items():
            print(f"RESULT   trace breakdown: {label:<28} {sec:6.2f} s in {calls} calls",
                  flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=630, help="steps per variant")
    ap.add_argument("--warmup-steps", type=int, default=63, help="DGC's warm-up length")
    ap.add_argument("--model", help="a tf.keras.applications model (e.g. MobileNetV2, "
                    "ResNet50) instead of the example's")
    ap.add_argument("--image", type=int, default=64, help="--model: image side (pixels)")
    ap.add_argument("--batch", type=int, default=4, help="--model: images per rank and step")
    ap.add_argument("--breakdown", action="store_true",
                    help="DGC: seconds of the trace in DGC's trace-time calls (rank 0)")
    ap.add_argument("--no-grappler", action="store_true",
                    help="diagnosis: TensorFlow's graph optimiser off in both variants")
    ap.add_argument("--inner", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.steps < 2 or not 0 <= args.warmup_steps < args.steps:
        ap.error("--steps must be >= 2 and --warmup-steps in [0, steps)")
    if args.inner:
        return _inner(args.inner, args.steps, args.warmup_steps, args.model, args.image,
                      args.batch, args.breakdown, not args.no_grappler)
    model_args = ["--model", args.model, "--image", str(args.image), "--batch",
                  str(args.batch)] if args.model else []
    model_args += ["--breakdown"] if args.breakdown else []
    model_args += ["--no-grappler"] if args.no_grappler else []
    bindir = os.path.dirname(sys.executable)
    env = dict(os.environ, TF_USE_LEGACY_KERAS="1", TF_CPP_MIN_LOG_LEVEL="3",
               PATH=bindir + os.pathsep + os.environ.get("PATH", ""),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load "
          f"{os.getloadavg()[0]:.1f}, {args.steps} steps, warm-up {args.warmup_steps}, "
          f"2 ranks (Gloo), model {args.model or 'examples/tf_model.py'}"
          + (f" {args.image}x{args.image}, batch {args.batch}" if args.model else "")
          + (", Grappler off" if args.no_grappler else ""))
    for variant in ("none", "dgc"):
        proc = subprocess.run(
            [os.path.join(bindir, "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo",
             sys.executable, os.path.abspath(__file__), "--inner", variant,
             "--steps", str(args.steps), "--warmup-steps", str(args.warmup_steps)]
            + model_args,
            cwd=ROOT, env=env, capture_output=True, text=True)
        lines = [ln.split("RESULT ", 1)[1] for ln in proc.stdout.splitlines() if "RESULT " in ln]
        if proc.returncode != 0 or not lines:
            raise SystemExit(f"{variant}: failed (exit {proc.returncode}):\n"
                             f"{(proc.stdout + proc.stderr)[-3000:]}")
        print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
