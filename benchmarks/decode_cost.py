"""What DGC's receive side costs on this CPU per step, ResNet-50's shapes, measured in one run.

N simulated ranks (default 2) each compress random gradients with ResNet-50's 161 shapes
(benchmarks/shapes.py) through ``DGCCore.compress_many``, bucket by bucket as the PyTorch adapter
plans them (default settings: ``bucket_numel`` 2**22, 1-D tensors dense); each bucket's frames are
concatenated in rank order (what Horovod's allgather returns). Then, per step, rank 0's receive
side is timed as the adapter runs it: per bucket ``DGCCore.split_bucket``, then per sparsified
member the concatenation of its payloads and ``DGCCore.decompress`` into the gradient's own
storage (``out``, what the adapter passes for a float32 gradient). Timed with two engines
(dgc_horovod/core/engine.py) in interleaved rounds: the C engine (``engine="c"``) and the tensor
ops (``engine="ops"``, the reference); beside them the floor that no decode avoids, zero-filling
the members' outputs (``zero_``). Checks that both give the same bits.

    python benchmarks/decode_cost.py [--ranks 2] [--repeats 9] [--profile 25]
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shapes import resnet50  # noqa: E402

from dgc_horovod.core import DGCConfig, DGCCore, wire  # noqa: E402
from dgc_horovod.core.buckets import plan_buckets  # noqa: E402
from dgc_horovod.backends.torch_backend import TorchBackend  # noqa: E402


def setup(ranks, seed=0):
    """(cores, [(bucket name, member count, gathered, [(member, name, ctx)])], outs)."""
    config = DGCConfig(momentum=0.9, warmup_steps=0, environ={})
    B = TorchBackend()
    shapes = list(reversed(resnet50()))                      # plan order: reverse registration
    plan = plan_buckets([(n, torch.Size(s).numel(), len(s)) for n, s in shapes],
                        config.bucket_numel, config)
    numel = {n: torch.Size(s).numel() for n, s in shapes}
    shape = dict(shapes)
    cores = [DGCCore(config, B) for _ in range(ranks)]
    gen = torch.Generator().manual_seed(seed)
    frames, contexts = [[] for _ in range(ranks)], [{} for _ in range(ranks)]
    for r, core in enumerate(cores):
        for members, flags in plan:
            sparse = [(m, n) for m, (n, s) in enumerate(zip(members, flags)) if s]
            if not sparse:
                frames[r].append(None)
                continue
            res = core.compress_many([(n, torch.randn(shape[n], generator=gen), None)
                                      for _, n in sparse], ranks)
            contexts[r].update({n: x[2] for (_, n), x in zip(sparse, res)})
            frames[r].append(wire.frame_bucket(B, [(m, x[1]) for (m, _), x in zip(sparse, res)],
                                               like=res[0][1]))
    buckets = []
    for b, (members, flags) in enumerate(plan):
        if frames[0][b] is None:
            continue
        gathered = torch.cat([frames[r][b] for r in range(ranks)])
        buckets.append(("dgc.bucket." + members[0], len(members), gathered,
                        [(m, n, contexts[0][n]) for m, (n, s) in enumerate(zip(members, flags))
                         if s]))
    outs = {n: torch.empty(numel[n]) for b in buckets for _, n, _ in b[3]}
    return cores, buckets, outs


def receive(core, buckets, outs, ranks):
    """Rank 0's receive side of one step, as the adapter runs it (exchange.receive + decompress)."""
    B = core.B
    for name, members, gathered, sparse in buckets:
        parts = core.split_bucket(gathered, ranks, members, name)
        for m, n, ctx in sparse:
            got = parts[m]
            core.decompress(B.cat(got) if got else got, ctx, ranks, True, len(got), outs[n])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="also cProfile 3 steps of each way and print the top N by tottime")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cores, buckets, outs = setup(args.ranks)
    core = cores[0]
    tensors = sum(len(b[3]) for b in buckets)
    elements = sum(o.numel() for o in outs.values())
    print(f"# ResNet-50 shapes, {args.ranks} ranks, {len(buckets)} buckets, {tensors} sparsified "
          f"tensors ({elements:,} elements), density {core.density:g}; 1 torch thread; "
          f"load average {os.getloadavg()[0]:.2f} at start")

    def way(engine):
        decoder = DGCCore(DGCConfig(momentum=0.9, warmup_steps=0, engine=engine, environ={}),
                          core.B)
        return lambda: receive(decoder, buckets, outs, args.ranks)

    def zero():
        for o in outs.values():
            o.zero_()

    fns = {"C engine": way("c"), "tensor ops": way("ops"), "zero_ only": zero}
    got = {}
    for label in ("C engine", "tensor ops"):
        fns[label]()
        got[label] = {n: o.clone() for n, o in outs.items()}
    same = all(torch.equal(got["C engine"][n].view(torch.int32),
                           got["tensor ops"][n].view(torch.int32)) for n in outs)
    times = {k: [] for k in fns}
    for _ in range(args.repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    for k, v in times.items():
        print(f"{k:>10}: {1e3 * statistics.median(v):7.2f} ms per step (median of {args.repeats}, "
              f"min {1e3 * min(v):.2f})")
    print(f"# same bits, C engine and tensor ops: {same}; load average {os.getloadavg()[0]:.2f} "
          "at end")
    if args.profile:
        import cProfile
        import pstats
        for label in ("C engine", "tensor ops"):
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(3):
                fns[label]()
            prof.disable()
            print(f"# cProfile, {label}, 3 steps")
            pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(args.profile)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
