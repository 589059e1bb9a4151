"""Runs under `horovodrun -np L -H localhost:L --gloo`: Horovod's reduce-scatter against the
hierarchical exchange's rules for it (dgc_horovod/core/hierarchical.py): where it splits a flat
tensor (``shard_bounds``) and the order it adds the ranks' tensors in (``node_sum``, bit for
bit). Rank 0 writes what it found as JSON to --out."""
import argparse
import json

import horovod.torch as hvd
import torch

from dgc_horovod.core import hierarchical


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    L, r = hvd.size(), hvd.rank()
    n = 4096 * L + L - 1                    # not divisible by L: the split shows
    # values of very different sizes per rank, so that the order of the sum shows in the bits
    rows = [torch.randn(n, generator=torch.Generator().manual_seed(k)) * 10.0 ** (3 * (k % 3))
            for k in range(L)]
    got = hvd.reducescatter(rows[r], op=hvd.Sum, name="rs.sum")
    avg = hvd.reducescatter(rows[r], op=hvd.Average, name="rs.avg")
    lo, hi = hierarchical.shard_bounds(n, L)[r]
    want = hierarchical.node_sum(rows)
    ranked = rows[0].clone()
    for k in range(1, L):
        ranked += rows[k]
    facts = {"numel": got.numel(), "shard": hi - lo,
             "node_sum": bool(torch.equal(got, want[lo:hi])),
             "rank_order": bool(torch.equal(got, ranked[lo:hi])),
             # op=Average: the sum times 1/L in float32, as SimulatedCluster scales it
             "average": bool(torch.equal(avg, want[lo:hi].mul_(1.0 / L)))}
    facts = hvd.allgather_object(facts, name="rs.facts")
    if r == 0:
        with open(args.out, "w") as f:
            json.dump(facts, f)


if __name__ == "__main__":
    main()
