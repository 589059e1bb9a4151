"""Runs under `horovodrun -np N`: a small model trained with DGC through the stock
hvd.DistributedOptimizer; rank 0 saves the final parameters. tests/test_simulate.py trains the
same model on dgc_horovod.simulate.SimulatedCluster and compares the bits. (For
``exchange="hierarchical"`` launch it with HOROVOD_DYNAMIC_PROCESS_SETS=1.)"""
import argparse
import json

import horovod.torch as hvd
import torch
import torch.nn.functional as F

from dgc_horovod.torch import DGC

STEPS, LR = 30, 0.1


def make_model():
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32),
                               torch.nn.ReLU(), torch.nn.Linear(32, 10))


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(16, 20, generator=g), torch.randint(0, 10, (16,), generator=g)


def loss_of(model, rank, step):
    x, y = batch(rank, step)
    return F.cross_entropy(model(x), y)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True, help="DGC keyword arguments as JSON")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    hvd.init()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    dgc = DGC(**json.loads(args.config))
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=dgc)
    for step in range(STEPS):
        opt.zero_grad()
        loss_of(model, hvd.rank(), step).backward()
        opt.step()
    # every rank waits for the others: under exchange="hierarchical" a step ends with collectives
    # inside each node, so one node can finish first, and a rank that exits shuts Horovod down
    # under the other node's last allgather ("Horovod has been shut down" there)
    hvd.barrier()
    if hvd.rank() == 0:
        torch.save({"params": {n: p.detach().clone() for n, p in model.named_parameters()},
                    "steps": dgc._core.steps, "density": dgc.density,
                    "wire_bytes": dgc.total_stats.wire_bytes,
                    "received_bytes": dgc.total_stats.received_bytes,
                    "stats": dgc.total_stats.to_dict()}, args.out)


if __name__ == "__main__":
    main()
