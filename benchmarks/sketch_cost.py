"""What ``clip_scope="sketch"`` costs a rank per step, beside the paper's global clip, on real
models' gradient shapes (benchmarks/shapes.py), PyTorch on this machine's CPU, one thread:

- the time of ``DGCCore.sketch`` (the rank's CountSketch of all of its gradients; codes made at
  the first call and kept) against ``DGCCore.clip_scale`` (the global clip's norm over the same
  gradients), measured in the same rounds, alternating;
- the codes' memory (4 bytes per element) and the allgather's bytes per rank (2 KB sent,
  (N − 1)·2 KB received);
- the estimate's error: N = 4 ranks' gradients that share a component (g_k = a·z + e_k, z
  shared, e_k each rank's own) so that the reduced gradient's norm is neither the ranks' norm
  nor 1/√N of it; the relative error of the estimated ‖ḡ‖ over ``--draws`` draws.

    python benchmarks/sketch_cost.py [--models resnet50 lstm_lm mnist_cnn] [--rounds 5]
"""
import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shapes import MODELS  # noqa: E402

from dgc_horovod.backends.torch_backend import TorchBackend  # noqa: E402
from dgc_horovod.core import DGCConfig, DGCCore  # noqa: E402
from dgc_horovod.core import sketch as S  # noqa: E402


def measure(model, rounds, draws, N=4):
    shapes = MODELS[model]()
    numel = sum(math.prod(s) for _, s in shapes)
    gen = torch.Generator().manual_seed(0)
    grads = [(n, torch.randn(s, generator=gen)) for n, s in shapes]
    core = DGCCore(DGCConfig(environ={}, clip_norm=1.0, clip_scope="sketch"), TorchBackend())
    paper = DGCCore(DGCConfig(environ={}, clip_norm=1.0), TorchBackend())
    t0 = time.perf_counter()
    core.sketch(grads)                      # the codes, once
    first = time.perf_counter() - t0
    t_sketch, t_norm = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        core.sketch(grads)
        t_sketch.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        paper.clip_scale([g for _, g in grads], N)
        t_norm.append(time.perf_counter() - t0)
    errors = []
    for d in range(draws):
        z = [torch.randn(s, generator=gen) for _, s in shapes]
        ranks = [[(n, 0.5 * zi + torch.randn(s, generator=gen)) for (n, s), zi in zip(shapes, z)]
                 for _ in range(N)]
        rows = [core.sketch(r).tolist() for r in ranks]
        est = math.sqrt(S.estimate(rows)) / N
        true = math.sqrt(sum(float(sum(r[i][1] for r in ranks).norm()) ** 2
                             for i in range(len(shapes)))) / N
        errors.append(est / true - 1)
    mean = sum(errors) / len(errors)
    std = math.sqrt(sum((e - mean) ** 2 for e in errors) / max(1, len(errors) - 1))
    sent, received = S.sketch_bytes(N)
    return dict(model=model, numel=numel, first_ms=first * 1e3,
                sketch_ms=min(t_sketch) * 1e3, norm_ms=min(t_norm) * 1e3,
                codes_mb=numel * 4 / 2 ** 20, sent=sent, received=received,
                err_mean=mean, err_std=std, err_max=max(abs(e) for e in errors))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["resnet50", "lstm_lm", "mnist_cnn"],
                   choices=sorted(MODELS))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--draws", type=int, default=10)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    print(f"clip_scope='sketch', W = {S.WIDTH}, N = 4, torch {torch.__version__} CPU, 1 thread; "
          "times: the fastest of --rounds")
    print("| model | elements | sketch ms | global clip's norm ms | ratio | first call ms "
          "(codes) | codes MiB | bytes sent / received | ‖ḡ‖ error: mean ± std (max) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for m in a.models:
        r = measure(m, a.rounds, a.draws)
        print(f"| {m} | {r['numel']:,} | {r['sketch_ms']:.1f} | {r['norm_ms']:.1f} | "
              f"{r['sketch_ms'] / r['norm_ms']:.1f}× | {r['first_ms']:.0f} | "
              f"{r['codes_mb']:.1f} | {r['sent']:,} / {r['received']:,} | "
              f"{r['err_mean']:+.2%} ± {r['err_std']:.2%} ({r['err_max']:.2%}) |")


if __name__ == "__main__":
    main()
