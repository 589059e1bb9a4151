"""What compress costs for the tensors DGC does not sparsify, measured side by side in one run.

ResNet-50's 107 one-dimensional tensors (biases and batch-norm scales, 54,120 elements; shapes
from benchmarks/shapes.py) are not sparsified with the default ``min_sparse_ndim=2``: per step
each one's gradient goes through ``DGCCore.compress`` on its own (the PyTorch adapter calls it
from Horovod's hook when that gradient is ready; its velocity is what Horovod's allreduce
carries). Times one step of them (107 calls, default settings, momentum 0.9, 1 torch thread)
against the same torch operations without DGC around them (per tensor: the finiteness check's
sum, the velocity's zeros, u ← m·u + g and v ← v + u), in interleaved rounds; ms per step,
median and minimum over the rounds, and the ratio of the medians.

    python benchmarks/dense_cost.py [--repeats 30]

To compare two checkouts, run this file with ``PYTHONPATH=<checkout>`` set to each in turn.
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shapes import resnet50  # noqa: E402

from dgc_horovod.core import DGCConfig, DGCCore  # noqa: E402
from dgc_horovod.backends.torch_backend import TorchBackend  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    tensors = [(n, torch.randn(s, generator=gen), torch.randn(s, generator=gen))
               for n, s in resnet50() if len(s) < 2]
    core = DGCCore(DGCConfig(momentum=0.9, warmup_epochs=0, environ={}), TorchBackend())
    us = [torch.zeros(g.numel()) for _, g, _ in tensors]

    def dgc_step():
        for name, g, p in tensors:
            core.compress(name, g, 2, p)

    def ops_step():
        for (_, g, _), u in zip(tensors, us):
            g = g.view(-1)
            g.sum().item()
            torch.add(g, u, alpha=0.9, out=u)
            torch.zeros(g.numel()).add_(u)

    times = {"DGCCore.compress": [], "the torch ops alone": []}
    steps = list(zip(times, (dgc_step, ops_step)))
    for _ in range(3):
        for _, step in steps:
            step()
    for _ in range(args.repeats):
        for key, step in steps:
            t0 = time.perf_counter()
            step()
            times[key].append(time.perf_counter() - t0)
    assert all(not core.states[n].sparse for n, _, _ in tensors)
    print(f"# {len(tensors)} dense tensors of ResNet-50 ({sum(g.numel() for _, g, _ in tensors):,} "
          f"elements), one step, {args.repeats} interleaved rounds, 1 torch thread; "
          f"load average {os.getloadavg()[0]:.2f}")
    for key, ts in times.items():
        print(f"{key:>22}: median {1e3 * statistics.median(ts):.2f} ms, min {1e3 * min(ts):.2f} ms")
    a, b = (statistics.median(ts) for ts in times.values())
    print(f"ratio (medians): {a / b:.2f}x")


if __name__ == "__main__":
    main()
