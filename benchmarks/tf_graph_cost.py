"""What DGC's per-step work costs in TensorFlow, in the graph (``DGC(in_graph=True)``, the default)
and in ``tf.py_function`` (``in_graph=False``), side by side in one run, on one rank's CPU.

One step of every gradient of a model (shapes from benchmarks/shapes.py; ResNet-50 by default),
as the TensorFlow adapter runs it between Horovod's collectives, with the collectives replaced
by their result for 2 ranks that sent the same payloads (the allgather: this rank's payload
twice; the dense allreduce: the velocity's sum times 1/2), after the warm-up (density
``--density``):

- ``buckets``: :class:`dgc_horovod.tensorflow.graph.GraphCore`'s step_ops, then bucket_ops for
  the sparsified tensors in the adapter's buckets (``bucket_numel``, the default: one framed
  allgather per bucket) and compress_ops for the dense ones, then decompress_ops for every
  tensor, traced into one ``tf.function`` (what the adapter traces);
- ``per tensor``: the same with compress_ops for every tensor (``bucket_numel=0``: one
  allgather per sparsified tensor);
- ``host``: :class:`dgc_horovod.core.DGCCore` on NumPy arrays (the fused C kernels): compress and
  decompress per tensor, eagerly, as ``in_graph=False`` runs them without a GPU inside its
  ``tf.py_function`` ops (not counted: TensorFlow's copies into and out of those ops);
- ``tf-ops`` (``--tf-ops``): the same eager core on TensorFlow ops (``in_graph=False``,
  ``device="gpu"``, here on the CPU);

against one memory pass, a traced ``tf.function`` that adds every gradient into a variable of its
size (``assign_add``). Rounds are interleaved (each round runs every line once); a ratio is the
median over the rounds of the line's time divided by the same round's memory pass. Also prints
the graphs' size: the ops of each traced step (its branches and loop bodies included), per
tensor.

With ``--profile``, TensorFlow's profiler then records 3 steps of each graph variant and the
benchmark prints the kernel time per step by op type (where the executor's own time is the
rest of the step).

    python benchmarks/tf_graph_cost.py [--model resnet50] [--density 0.001] [--repeats 9]
                                       [--min-sparse-ndim 2] [--threads 1] [--tf-ops]
                                       [--profile]
"""
import argparse
import collections
import glob
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np              # noqa: E402
import tensorflow as tf         # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shapes import MODELS       # noqa: E402

from dgc_horovod.backends.tf_backend import TFBackend     # noqa: E402
import dgc_horovod.tensorflow.graph as graph_module     # noqa: E402
from dgc_horovod.core import DGCConfig, DGCCore           # noqa: E402
from dgc_horovod.core.backend import NumpyBackend         # noqa: E402
from dgc_horovod.tensorflow.graph import GraphCore, hvd   # noqa: E402

WORLD = 2


class _ProcessSet:
    """Stands in for Horovod's process set: the world size the graph reads."""

    process_set_id = 0

    def size(self):
        return WORLD

    def included(self):
        return True


def graph_step(core, names):
    """The traced step of one rank (the collectives replaced by their 2-rank result)."""
    @tf.function
    def step(grads):
        s = core.step_ops(grads, grads[0], _ProcessSet(), True)
        out = []
        for name, g in zip(names, grads):
            kind, sent, ctx = core.compress_ops(name, g, s, True)
            if kind == "dense":
                result, words = (sent + sent) * (1.0 / WORLD), 0
            else:
                result, words = tf.concat([sent, sent], 0), tf.size(sent, out_type=tf.int64)
            out.append(core.decompress_ops(name, result, ctx, s, words, True))
        return out
    return step


class _Allgather:
    """Stands in for ``horovod.tensorflow`` in the graph module: an allgather of 2 ranks that
    sent the same segment."""

    def __getattr__(self, name):
        return getattr(hvd, name)

    @staticmethod
    def allgather(x, name=None, process_set=None):
        return tf.concat([x, x], 0)


def bucket_step(core, names, grads):
    """The traced step of one rank with the sparsified tensors in buckets (``bucket_numel``,
    :meth:`GraphCore.plan_ops`, as the adapter plans them), the collectives replaced."""
    graph_module.hvd = _Allgather()

    @tf.function
    def step(grads):
        s = core.step_ops(grads, grads[0], _ProcessSet(), True)
        ctx = core.plan_ops(list(zip(names, grads, [None] * len(grads))), s, _ProcessSet(), True)
        out = []
        for name, g in zip(names, grads):
            if name in ctx:
                c, decoded = ctx[name]
                out.append(core.decompress_ops(name, decoded, c, s, None, True))
                continue
            kind, sent, c = core.compress_ops(name, g, s, True)
            out.append(core.decompress_ops(name, (sent + sent) * (1.0 / WORLD), c, s, 0, True))
        return out
    return step


def eager_step(core, names, grads):
    """One step of the eager core, as in_graph=False runs it per tensor."""
    B = core.B
    for name, g in zip(names, grads):
        kind, sent, ctx = core.compress(name, g, WORLD)
        if kind == "dense":
            B.float32_flat((sent + sent) * (1.0 / WORLD))
        else:
            core.decompress(B.cat([sent, sent]), ctx, WORLD)


def graph_ops(concrete):
    """Ops of a traced (concrete) function's graph, the functions it calls (branches, loop
    bodies) included."""
    gd = concrete.graph.as_graph_def()
    return len(gd.node) + sum(len(f.node_def) for f in gd.library.function)


def profile(fn, grads, steps=3):
    """Kernel time per step by op type (ms, count), from TensorFlow's profiler over ``steps``
    runs of ``fn``; the executor's per-step event ("Process") as ("step", count of ops run)."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2
    with tempfile.TemporaryDirectory() as logdir:
        tf.profiler.experimental.start(logdir)
        for _ in range(steps):
            fn(grads)
        tf.profiler.experimental.stop()
        space = xplane_pb2.XSpace()
        with open(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)[0],
                  "rb") as f:
            space.ParseFromString(f.read())
    ms, count = collections.Counter(), collections.Counter()
    for plane in space.planes:
        for line in plane.lines:
            if "Eigen" in line.name:        # the kernels' worker threads: counted by their op
                continue
            for ev in line.events:
                name = plane.event_metadata[ev.metadata_id].name
                kind = name.rsplit(":", 1)[-1].strip()
                if kind == "Process":               # the executor's event for the step
                    kind = "step"
                elif ":" not in name or kind == "Run" or kind.startswith("__inference"):
                    continue
                if kind:
                    ms[kind] += ev.duration_ps / 1e9 / steps
                    count[kind] += 1 / steps
    return ms, count


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="resnet50", choices=sorted(MODELS))
    ap.add_argument("--density", type=float, default=0.001)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--min-sparse-ndim", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="TensorFlow intra-op threads")
    ap.add_argument("--tf-ops", action="store_true", help="also the eager core on TF ops")
    ap.add_argument("--profile", action="store_true",
                    help="then the kernel time per op type of both graph variants")
    args = ap.parse_args()
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    shapes = MODELS[args.model]()
    names = [n for n, _ in shapes]
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(s).astype(np.float32) for _, s in shapes]
    grads = [tf.constant(a) for a in arrays]
    config = DGCConfig(environ={}, compress_ratio=args.density, warmup_steps=0,
                       min_sparse_ndim=args.min_sparse_ndim)

    graph = graph_step(GraphCore(config, TFBackend()), names)
    buckets = bucket_step(GraphCore(config, TFBackend()), names, grads)
    host = DGCCore(config, NumpyBackend())
    sinks = [tf.Variable(tf.zeros_like(g)) for g in grads]

    @tf.function
    def memory_pass(grads):
        for v, g in zip(sinks, grads):
            v.assign_add(g)

    lines = [("one memory pass (assign_add)", lambda: memory_pass(grads)),
             ("DGC in the graph, buckets (default)", lambda: buckets(grads)),
             ("DGC in the graph, per tensor", lambda: graph(grads)),
             ("DGC in tf.py_function, C kernels", lambda: eager_step(host, names, arrays))]
    if args.tf_ops:
        ops = DGCCore(config, TFBackend())
        lines.append(("DGC in tf.py_function, TF ops", lambda: eager_step(ops, names, grads)))
    for _, fn in lines:         # traces, first allocations
        fn()
        fn()
    rounds = []
    for _ in range(args.repeats):
        row = []
        for _, fn in lines:
            t0 = time.perf_counter()
            fn()
            row.append(time.perf_counter() - t0)
        rounds.append(row)
    n = sum(a.size for a in arrays)
    sparse = sum(1 for _, s in shapes if len(s) >= args.min_sparse_ndim)
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load "
          f"{os.getloadavg()[0]:.1f}; {args.model}: {len(shapes)} tensors ({sparse} sparsified, "
          f"min_sparse_ndim={args.min_sparse_ndim}), {n:,} elements, density {args.density}, "
          f"{WORLD} ranks simulated, TensorFlow threads {args.threads}, {args.repeats} rounds")
    for j, (label, _) in enumerate(lines):
        t = statistics.median(r[j] for r in rounds)
        ratio = statistics.median(r[j] / r[0] for r in rounds)
        print(f"  {label:<36} {1e3 * t:8.1f} ms   {ratio:6.2f}x")
    for label, fn in (("buckets", buckets), ("per tensor", graph)):
        total = graph_ops(fn.get_concrete_function(grads))
        print(f"  the traced step, {label}: {total:,} ops ({total / len(shapes):.0f} per "
              f"tensor)")
    print(f"  the memory pass: {graph_ops(memory_pass.get_concrete_function(grads)):,} ops")
    if args.profile:
        got = {label: profile(fn, grads) for label, fn in (("buckets", buckets),
                                                            ("per tensor", graph))}
        ms = {label: m["step"] for label, (m, _) in got.items()}
        print("  kernel time per step by op type (TensorFlow's profiler, 3 steps); the last "
              "line: the executor's time for the step, and the ops it ran")
        print(f"  {'op type':<28} {'buckets ms':>10} {'ops':>6} {'per tensor ms':>14} {'ops':>6}")
        kinds = sorted((set(got["buckets"][0]) | set(got["per tensor"][0])) - {"step"},
                       key=lambda k: -sum(got[v][0][k] for v in got))
        for kind in kinds[:25]:
            row = [f"{got[v][0][kind]:{w}.2f} {got[v][1][kind]:6.0f}"
                   for v, w in (("buckets", 10), ("per tensor", 14))]
            print(f"  {kind:<28} {row[0]} {row[1]}")
        ops = {label: c["step"] for label, (_, c) in got.items()}
        print(f"  step (the executor)          {ms['buckets']:10.2f} {ops['buckets']:6.0f} "
              f"{ms['per tensor']:14.2f} {ops['per tensor']:6.0f}")


if __name__ == "__main__":
    main()
