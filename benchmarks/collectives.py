"""Horovod collectives per training step with DGC, requested and actually executed.

Launches itself under ``horovodrun -np 2`` (Gloo) with HOROVOD_TIMELINE, trains a model whose
parameters have ResNet-50's 161 shapes (synthetic gradients: loss = Σ_p ⟨p, c_p⟩ with fixed random
c_p, so backward produces every gradient through Horovod's hooks) with the stock
``hvd.DistributedOptimizer`` and, in turn, no compression, DGC with one allgather per tensor
(``bucket_numel=0``, before) and DGC with its default buckets (after). From Horovod's own
timeline it counts per step: the collective *requests* (one allreduce per tensor, plus one
allgather per sparsified tensor for DGC), and the collectives Horovod actually *executed* after
its tensor fusion (requests that start at the same timestamp are one fused operation).

    python benchmarks/collectives.py [--steps 6]
"""
import argparse
import collections
import json
import math
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def worker(args):
    import horovod.torch as hvd
    import torch

    sys.path.insert(0, HERE)
    from shapes import resnet50

    from dgc_horovod.torch import DGC

    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    params = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(s)) for _, s in resnet50())
    coeffs = [torch.randn(p.shape) for p in params]
    named = [(n, p) for (n, _), p in zip(resnet50(), params)]
    if args.compression == "none":
        compression = hvd.Compression.none
    else:                                    # "dgc" (default buckets) or "dgc-per-tensor"
        compression = DGC(compress_ratio=0.001, momentum=0.9, warmup_epochs=0,
                          bucket_numel=0 if args.compression == "dgc-per-tensor" else 2 ** 22)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=1e-3), named_parameters=named,
                                   compression=compression)
    for _ in range(args.steps):
        opt.zero_grad()
        sum((p * c).sum() for p, c in zip(params, coeffs)).backward()
        opt.step()


def count(timeline, steps):
    text = open(timeline).read().rstrip().rstrip(",")
    events = json.loads(text if text.endswith("]") else text + "]")
    names = {e["pid"]: e["args"]["name"] for e in events
             if e.get("name") == "process_name" and "name" in e.get("args", {})}
    requests = collections.Counter()
    executed = collections.defaultdict(set)
    for e in events:
        if e.get("ph") == "B" and e.get("name") in ("GLOO_ALLREDUCE", "GLOO_ALLGATHER"):
            kind = e["name"][5:].lower()
            if names.get(e["pid"], "").startswith(("allreduce.", "allgather.dgc.")):
                requests[kind] += 1
                executed[kind].add(e["ts"])
    return {k: (requests[k] / steps, len(executed[k]) / steps) for k in requests}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--compression", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.compression:                     # inside horovodrun
        return worker(args)
    bindir = os.path.dirname(sys.executable)
    print(f"ResNet-50 shapes (161 tensors), 2 ranks (Gloo), {args.steps} steps; per step:")
    print(f"{'compression':>15} {'kind':>10} {'requested':>10} {'executed (fused)':>17}")
    for compression in ("none", "dgc-per-tensor", "dgc"):
        with tempfile.TemporaryDirectory() as tmp:
            tl = os.path.join(tmp, "timeline.json")
            env = dict(os.environ, HOROVOD_TIMELINE=tl, TF_CPP_MIN_LOG_LEVEL="3")
            subprocess.run([os.path.join(bindir, "horovodrun"), "-np", "2", "-H", "localhost:2",
                            "--gloo", sys.executable, os.path.abspath(__file__), "--steps",
                            str(args.steps), "--compression", compression],
                           env=env, check=True, capture_output=True)
            for kind, (req, exe) in sorted(count(tl, args.steps).items()):
                print(f"{compression:>15} {kind:>10} {req:>10.1f} {exe:>17.1f}")


if __name__ == "__main__":
    main()
