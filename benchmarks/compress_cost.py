"""What DGC's compress step costs on this CPU, measured side by side in one run.

1. ``resnet``: ResNet-50's 161 gradient tensors (25,557,032 elements, shapes from
   benchmarks/shapes.py), one step of ``DGCCore.compress_many`` per bucket as the PyTorch adapter
   cuts them (``bucket_numel`` 2**22), on PyTorch CPU tensors, with each engine
   (dgc_horovod/core/engine.py: ``engine="c"``, the C kernels; ``engine="ops"``, tensor ops),
   against one plain memory pass over the same gradients (an in-place add) and exact per-tensor
   top-k (torch.topk) alone, in interleaved rounds; with 1 torch thread and with torch's
   default (the C engine uses as many threads as torch's intra-op pool). Each DGC line also
   says how much of its step the buckets took and how much the dense tensors (biases).
   ``--against DIR`` adds the same step of the dgc_horovod in another checkout DIR (built: its C
   extension in place) and of this one, each run in a worker process of its own (so that
   neither shares a process with the other lines' torch threads) and timed in the same
   interleaved rounds: the CPU path side by side with another version of itself (e.g. the last
   landed one:
   ``git worktree add /tmp/base main && (cd /tmp/base && python setup.py build_ext --inplace)``).
2. ``recall``: how often the sampled selection is the exact top-k (the rule's usual case,
   dgc_horovod/core/sparsify.py), on Gaussian, Laplace, Student-t (3 dof) and tie-heavy
   gradients.
3. ``scaling``: cost per element of compress (C engine) for tensors of 1e4 … 1e8 elements, in
   buckets as the adapter makes them (ceil(2**22 / n) tensors of n elements per compress_many
   call) and one compress() per tensor, in interleaved rounds.

    python benchmarks/compress_cost.py [--repeats 9] [--density 0.004] [--max-elements 1e8]
                                       [--parts resnet,recall,scaling] [--against DIR]

The GPU's numbers come from benchmarks/gpu_check.py.
"""
import argparse
import math
import os
import pickle
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from shapes import resnet50  # noqa: E402

from dgc_horovod.core import DGCConfig, DGCCore  # noqa: E402
from dgc_horovod.core.buckets import plan_buckets  # noqa: E402
from dgc_horovod.core.sparsify import k_for  # noqa: E402
from dgc_horovod.backends.torch_backend import TorchBackend  # noqa: E402


def interleaved(fns, repeats):
    """Median time of each function and median of each one's ratio to the first, measured in
    rounds (each round runs every function once, in order, after one warm-up call each), so
    that a slow spell of a shared machine affects all of them alike. A function that returns a
    tuple of parts: also the medians of its parts (third result, {index: medians})."""
    for fn in fns:
        fn()
    rounds, parts = [], {}
    for _ in range(repeats):
        times = []
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            got = fn()
            times.append(time.perf_counter() - t0)
            if isinstance(got, tuple):
                parts.setdefault(i, []).append(got)
        rounds.append(times)
    medians = [statistics.median(r[i] for r in rounds) for i in range(len(fns))]
    ratios = [statistics.median(r[i] / r[0] for r in rounds) for i in range(len(fns))]
    return medians, ratios, {i: [statistics.median(p) for p in zip(*got)]
                             for i, got in parts.items()}


def adapter_buckets(entries, config, bucket_numel=2 ** 22):
    """The PyTorch adapter's buckets (dgc_horovod/torch/exchange.py, core.buckets.plan_buckets):
    the parameters in reverse registration order, cut into consecutive groups of about
    bucket_numel elements; a bucket's compress_many gets its sparsified tensors, the others are
    compressed one by one (dense allreduce). Returns (buckets, dense entries)."""
    by_name = {e[0]: e for e in entries}
    buckets, dense = [], []
    for members, sparse in plan_buckets([(n, g.numel(), g.dim()) for n, g, _ in entries[::-1]],
                                        bucket_numel, config):
        buckets.append([by_name[n] for n, s in zip(members, sparse) if s])
        dense += [by_name[n] for n, s in zip(members, sparse) if not s]
    return [b for b in buckets if b], dense


def new_core(density, engine="auto", min_sparse_ndim=1):
    """engine None: the config's default (a checkout from before the option, --against)."""
    kw = {} if engine is None else {"engine": engine}
    return DGCCore(DGCConfig(compress_ratio=density, warmup_steps=0, environ={},
                             min_sparse_ndim=min_sparse_ndim, **kw), TorchBackend())


class Step:
    """One compress step of ResNet-50's buckets on a DGCCore (of this tree or, in a worker,
    of another): ``run()`` compresses every bucket once."""

    def __init__(self, density, engine, threads, min_sparse_ndim=1, seed=0):
        torch.set_num_threads(threads)
        gen = torch.Generator().manual_seed(seed)
        self.shapes = resnet50()
        self.grads = [torch.randn(s, generator=gen) for _, s in self.shapes]
        self.core = new_core(density, engine, min_sparse_ndim)
        self.buckets, self.dense = adapter_buckets(
            [(n, g, None) for (n, _), g in zip(self.shapes, self.grads)], self.core.config)

    def run(self):
        """One step; returns (seconds of the buckets, seconds of the dense tensors)."""
        t0 = time.perf_counter()
        for bucket in self.buckets:
            self.core.compress_many(bucket, world_size=8)
        t1 = time.perf_counter()
        for name, g, _ in self.dense:
            self.core.compress(name, g, world_size=8)
        return t1 - t0, time.perf_counter() - t1


class Worker:
    """A Step in a process whose dgc_horovod is another checkout's (``--against``): each call
    runs one step there and returns its time."""

    def __init__(self, tree, density, threads, min_sparse_ndim):
        env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", str(density), str(threads),
             str(min_sparse_ndim)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
            cwd=os.path.abspath(tree))
        self.where = pickle.load(self.proc.stdout)             # its dgc_horovod's path

    def __call__(self):
        self.proc.stdin.write(b"s")
        self.proc.stdin.flush()
        return pickle.load(self.proc.stdout)            # (buckets, dense) seconds

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


def _worker(density, threads, min_sparse_ndim):
    import dgc_horovod
    step = Step(density, None, threads, min_sparse_ndim)
    out = sys.stdout.buffer
    pickle.dump(os.path.dirname(dgc_horovod.__file__), out)
    out.flush()
    while sys.stdin.buffer.read(1):
        pickle.dump(step.run(), out)
        out.flush()


def resnet_cost(repeats, density, threads, min_sparse_ndim=1, against=None):
    """Part 1 (see the module docstring). Returns {line: ratio to the memory pass}."""
    steps = {e: Step(density, e, threads, min_sparse_ndim) for e in ("c", "ops")}
    grads = steps["c"].grads
    other = [torch.randn(g.shape) for g in grads]
    worker = None if against is None else Worker(against, density, threads, min_sparse_ndim)

    def add_pass():
        for a, b in zip(other, grads):
            a.add_(b)

    def exact_topk():
        for g in grads:
            torch.topk(g.abs().reshape(-1), k_for(g.numel(), density), sorted=False)

    lines = {"one memory pass (in-place add)": add_pass,
             "DGC per bucket, C engine": steps["c"].run,
             "DGC per bucket, tensor ops": steps["ops"].run,
             "exact top-k per tensor (topk)": exact_topk}
    if worker is not None:     # this tree in a worker process too: the same conditions
        here = Worker(os.path.dirname(HERE), density, threads, min_sparse_ndim)
        lines["DGC per bucket, this tree (a worker)"] = here
        lines[f"DGC per bucket, {against} (a worker)"] = worker
    try:
        medians, ratios, parts = interleaved(list(lines.values()), repeats)
    finally:
        if worker is not None:
            here.close()
            worker.close()
    n = sum(g.numel() for g in grads)
    b = steps["c"]
    print(f"ResNet-50 gradients: {len(grads)} tensors, {n:,} elements, density {density}, "
          f"{sum(map(len, b.buckets))} sparsified in {len(b.buckets)} buckets "
          f"(min_sparse_ndim={min_sparse_ndim}), torch threads {torch.get_num_threads()}, "
          f"load average {os.getloadavg()[0]:.2f}")
    print("  (median of the times; ratio: median over the rounds of each round's time / that "
          "round's memory pass)")
    for i, ((name, _), t, r) in enumerate(zip(lines.items(), medians, ratios)):
        split = (f"   (buckets {1e3 * parts[i][0]:.1f} ms, dense tensors {1e3 * parts[i][1]:.1f}"
                 " ms)" if i in parts else "")
        print(f"  {name:<40} {1e3 * t:8.1f} ms  {r:6.2f}x{split}")
    if worker is not None:
        print(f"  ({against}: dgc_horovod from {worker.where})")
    return dict(zip(lines, ratios))


def recall(n=1_000_000, density=0.001, seeds=3):
    """Part 2: the fraction of (gradient, seed) pairs whose selection is exactly the top-k of
    |v| (ties to the lower position), on four gradient distributions. Returns the lowest."""
    rng = np.random.default_rng(0)
    dists = {"gaussian": lambda: rng.standard_normal(n),
             "laplace": lambda: rng.laplace(size=n),
             "student-t(3)": lambda: rng.standard_t(3, n),
             "ties": lambda: np.round(rng.standard_normal(n) * 4) / 4}
    k = k_for(n, density)
    print(f"Selection (C engine) against the exact top-k, n = {n:,}, density {density} "
          f"(k = {k}), {seeds} seeds each")
    worst = 1.0
    for name, draw in dists.items():
        exact = 0
        for seed in range(seeds):
            v = draw().astype(np.float32)
            core = DGCCore(DGCConfig(compress_ratio=density, warmup_steps=0, momentum=0.0,
                                     min_sparse_ndim=1, seed=seed, environ={}), TorchBackend())
            _, payload, ctx = core.compress("g", torch.from_numpy(v.copy()), 1)
            got = np.sort(ctx.indices.numpy())
            want = np.sort(np.argsort(-np.abs(v), kind="stable")[:k])
            exact += got.tolist() == want.tolist()
        worst = min(worst, exact / seeds)
        print(f"  {name:<14} exact top-k in {exact}/{seeds}")
    return worst


def scaling(repeats, max_elements, density):
    """Part 3 (see the module docstring)."""
    print(f"Scale: C engine per element, density {density}, 1 torch thread")
    torch.set_num_threads(1)
    sizes = [int(10 ** e) for e in range(4, int(math.log10(max_elements)) + 1)]
    for n in sizes:
        count = max(1, math.ceil(2 ** 22 / n))
        grads = [(f"t{i}", torch.randn(n), None) for i in range(count)]
        many, one = new_core(density), new_core(density)
        other = [torch.randn(n) for _ in range(count)]

        def add_pass():
            for a, (_, g, _) in zip(other, grads):
                a.add_(g)

        def per_tensor():
            for name, g, _ in grads:
                one.compress(name, g, world_size=8)

        (t_pass, t_many, t_one), (_, r_many, r_one), _ = interleaved(
            [add_pass, lambda: many.compress_many(grads, world_size=8), per_tensor], repeats)
        total = n * count
        print(f"  {count:>5} x {n:>11,}: pass {1e9 * t_pass / total:6.2f} ns/elt, bucket "
              f"{1e9 * t_many / total:6.2f} ns/elt ({r_many:5.2f}x), per tensor "
              f"{1e9 * t_one / total:6.2f} ns/elt ({r_one:5.2f}x)")


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--density", type=float, default=0.004)
    p.add_argument("--max-elements", type=float, default=1e8)
    p.add_argument("--min-sparse-ndim", type=int, default=1,
                   help="1 (every tensor sparsified, as the paper counts) or 2 (the default "
                        "of DGCConfig: 1-D tensors dense)")
    p.add_argument("--parts", default="resnet,recall,scaling")
    p.add_argument("--against", default=None, metavar="DIR",
                   help="also time the dgc_horovod of the checkout DIR (built) in the same rounds")
    a = p.parse_args()
    parts = a.parts.split(",")
    if "resnet" in parts:
        for threads in sorted({1, torch.get_num_threads()}):
            resnet_cost(a.repeats, a.density, threads, a.min_sparse_ndim, a.against)
    if "recall" in parts:
        recall()
    if "scaling" in parts:
        scaling(a.repeats, a.max_elements, a.density)


if __name__ == "__main__":
    main()
