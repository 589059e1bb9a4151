"""What DGC's compress step costs on this CPU, measured side by side in one run.

1. ResNet-50's 161 gradient tensors (25,557,032 elements, shapes from benchmarks/shapes.py):
   per step, accumulate + select + encode for all tensors (dgc_horovod.core.DGCCore on PyTorch
   tensors, density 0.001, default settings; the fused C kernels, which are the default on CPU, and
   the tensor-op path, DGCCore.use_kernels = False) against one plain memory pass over the same
   gradients (an in-place add of one gradient set into another), and against exact per-tensor
   top-k (torch.topk) alone. Prints the ratios, once with 1 torch thread and once with torch's
   default thread count (the kernels use as many threads as torch's intra-op pool).
2. Selection quality: the L1 mass captured by the sampled selection (DGCCore.compress, fused path)
   against the exact top-k of the same count, on Gaussian, Laplace, Student-t (3 dof) and
   tie-heavy gradients.
3. Scale: cost per element of compress (fused path) on single tensors of 1e4 … 1e8 elements.

    python benchmarks/compress_cost.py [--repeats 5] [--max-elements 1e8]
"""
import argparse
import math
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shapes import resnet50  # noqa: E402

from dgc_horovod.core import DGCConfig, DGCCore  # noqa: E402
from dgc_horovod.core.sparsify import k_for  # noqa: E402
from dgc_horovod.torch.backend import TorchBackend  # noqa: E402


def timed(fn, repeats):
    fn()                                             # warm-up (allocations, first-touch)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def resnet_cost(repeats, density, threads):
    torch.set_num_threads(threads)
    shapes = resnet50()
    grads = [torch.randn(math.prod(s)) for _, s in shapes]
    other = [torch.randn(g.numel()) for g in grads]
    cores = []
    for use_kernels in (True, False):
        core = DGCCore(DGCConfig(compress_ratio=density, warmup_epochs=0), TorchBackend())
        core.use_kernels = use_kernels and core.use_kernels
        cores.append(core)

    def compress_all(core):
        for (name, _), g in zip(shapes, grads):
            core.compress(name, g, world_size=8)

    def add_pass():
        for a, b in zip(other, grads):
            a.add_(b)

    def exact_topk():
        for g in grads:
            torch.topk(g.abs(), k_for(g.numel(), density), sorted=False)

    t_pass, t_dgc, t_ops, t_topk = (timed(f, repeats) for f in (
        add_pass, lambda: compress_all(cores[0]), lambda: compress_all(cores[1]), exact_topk))
    n = sum(g.numel() for g in grads)
    fused = "fused C kernels" if cores[0].use_kernels else "KERNELS NOT BUILT: tensor ops"
    print(f"ResNet-50 gradients: {len(grads)} tensors, {n:,} elements, density {density}, "
          f"torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f}")
    print(f"  one memory pass (in-place add)   {1e3 * t_pass:8.1f} ms   1.00x")
    print(f"  DGC accumulate+select+encode     {1e3 * t_dgc:8.1f} ms   {t_dgc / t_pass:5.2f}x"
          f"   ({fused}, the default)")
    print(f"  ... the same on tensor ops       {1e3 * t_ops:8.1f} ms   {t_ops / t_pass:5.2f}x"
          "   (DGCCore.use_kernels = False: CUDA, TensorFlow)")
    print(f"  exact top-k per tensor (topk)    {1e3 * t_topk:8.1f} ms   {t_topk / t_pass:5.2f}x")
    return t_dgc / t_pass


def make_dist(kind, n, rng):
    if kind == "gaussian":
        return rng.standard_normal(n)
    if kind == "laplace":
        return rng.laplace(size=n)
    if kind == "student_t3":
        return rng.standard_t(3, size=n)
    if kind == "tie_heavy":                        # few distinct magnitudes, many exact ties
        return rng.choice([-2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0], size=n,
                          p=[0.0005, 0.05, 0.2, 0.499, 0.2, 0.05, 0.0005])
    raise ValueError(kind)


def recall(n=1_000_000, density=0.001, seeds=5):
    print(f"Selection quality, n={n:,}, density {density}: L1 mass of the sampled selection / "
          "L1 mass of the exact top-k of the same count (min over "
          f"{seeds} seeds)")
    worst = 1.0
    for kind in ("gaussian", "laplace", "student_t3", "tie_heavy"):
        ratios = []
        for seed in range(seeds):
            v = torch.from_numpy(make_dist(kind, n, np.random.default_rng(seed)).astype(np.float32))
            # momentum 0 and an empty residual: the selection runs on v itself
            core = DGCCore(DGCConfig(compress_ratio=density, warmup_epochs=0, momentum=0.0,
                                     momentum_masking=False, seed=seed), TorchBackend())
            idx = core.compress("v", v, world_size=1)[2].indices
            c = idx.numel()
            got = float(v[idx].abs().sum())
            best = float(torch.topk(v.abs(), c).values.sum()) if c else 0.0
            ratios.append(got / best if best else 1.0)
        worst = min(worst, min(ratios))
        print(f"  {kind:>11}: recall {min(ratios):.4f} (count {c:,} of k={k_for(n, density):,})")
    return worst


def scaling(repeats, max_elements, density):
    print(f"Cost per element of compress on one tensor (density {density}, "
          f"torch threads {torch.get_num_threads()}):")
    costs = []
    for e in range(4, int(round(math.log10(max_elements))) + 1):
        n = 10 ** e
        g = torch.randn(n)
        core = DGCCore(DGCConfig(compress_ratio=density, warmup_epochs=0), TorchBackend())
        t = timed(lambda: core.compress("w", g, world_size=8), max(1, repeats if e < 8 else 2))
        costs.append(t / n)
        print(f"  n=1e{e}: {1e3 * t:9.3f} ms  {1e9 * t / n:7.3f} ns/element")
        del g, core
    print(f"  max/min per-element cost: {max(costs) / min(costs):.2f}x")
    return max(costs) / min(costs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--density", type=float, default=0.001)
    ap.add_argument("--max-elements", type=float, default=1e8)
    args = ap.parse_args()
    torch.manual_seed(0)
    default_threads = torch.get_num_threads()
    print(f"{os.cpu_count()} CPUs; load average before: "
          + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    for threads in sorted({1, default_threads}):
        resnet_cost(args.repeats, args.density, threads)
    torch.set_num_threads(default_threads)
    recall(density=args.density)
    scaling(args.repeats, args.max_elements, args.density)


if __name__ == "__main__":
    main()
