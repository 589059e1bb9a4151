"""Bytes per rank per step on the wire, after warm-up, for each DGC wire format.

Runs the real compressor (dgc_horovod.core.DGCCore on PyTorch tensors) over the gradient shapes
of ResNet-50 (and a DeepSpeech-like model and the paper's LSTM language model), with Gaussian
gradients, at density 0.001, and counts every byte a rank sends: each sparsified tensor's payload
(header included) and its 4-byte placeholder in Horovod's allreduce, and the dense allreduce of
the tensors that are not sparsified. Prints the ratio to the dense fp32 gradient for three rules
of which tensors are sparsified: the default (1-D tensors dense, ``min_sparse_ndim=2``, as the
authors' reference code), every tensor (``min_sparse_ndim=1``), and tensors of 1024 elements
or more.

    python benchmarks/wire.py [--steps 3] [--models resnet50,lstm_lm,deepspeech_like]
"""
import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shapes import MODELS  # noqa: E402

from dgc_horovod.core import DGCConfig, DGCCore  # noqa: E402
from dgc_horovod.backends.torch_backend import TorchBackend  # noqa: E402

FORMATS = [("int32", "float32"), ("delta16", "float32"), ("delta16", "float16")]
#: which tensors are sparsified: (label, DGCConfig options)
RULES = [("1-D dense (default)", {}), ("every tensor", dict(min_sparse_ndim=1)),
         (">= 1024 elements", dict(min_sparse_ndim=1, min_sparse_numel=1024))]


def step_bytes(shapes, grads, steps, **cfg):
    core = DGCCore(DGCConfig(warmup_steps=0, environ={}, **cfg), TorchBackend())
    for _ in range(steps):
        for (name, _), g in zip(shapes, grads):
            core.compress(name, g, world_size=8)
    return core.step_stats


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--density", type=float, default=0.001)
    ap.add_argument("--models", default="resnet50,lstm_lm,deepspeech_like")
    args = ap.parse_args()
    torch.manual_seed(0)
    for model in args.models.split(","):
        shapes = MODELS[model]()
        grads = [torch.randn(math.prod(s)).view(s) for _, s in shapes]
        numel = sum(g.numel() for g in grads)
        dense = 4 * numel
        print(f"\n{model}: {len(shapes)} tensors, {numel:,} elements, dense fp32 "
              f"{dense / 2**20:.1f} MiB per rank per step, density {args.density}")
        print(f"{'index':>8} {'values':>8} {'sparsified':>20} {'sparse':>7} "
              f"{'bytes/step':>11} {'ratio':>8}")
        for label, rule in RULES:
            for index, values in FORMATS:
                st = step_bytes(shapes, grads, args.steps, compress_ratio=args.density,
                                wire_index=index, wire_values=values, **rule)
                print(f"{index:>8} {values:>8} {label:>20} {st.sparse_tensors:>7} "
                      f"{st.wire_bytes:>11,} {dense / st.wire_bytes:>7.0f}x")


if __name__ == "__main__":
    main()
