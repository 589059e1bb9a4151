"""Runs on each "host" of the two-host test bed (scripts/cluster/), launched by tests/test_cluster.py.

A dense allreduce of 4 Mi float32 (16 MiB, rank-dependent values, result checked exactly) and 5
DGC steps of a small model through the stock hvd.DistributedOptimizer; rank 0 writes the host
names, the allreduce check, the DGC statistics and whether the parameters are bit-identical on
both hosts to --out (JSON).
"""
import argparse
import json
import os
import socket

import horovod.torch as hvd
import torch

from dgc_horovod.torch import DGC

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
args = ap.parse_args()

hvd.init()
torch.set_num_threads(1)
rank, size = hvd.rank(), hvd.size()
hosts = hvd.allgather_object(socket.gethostname())

x = torch.full((1 << 22,), float(rank + 1))
y = hvd.allreduce(x, op=hvd.Sum, name="cluster.dense")
allreduce_ok = bool(torch.all(y == size * (size + 1) / 2))

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
dgc = DGC(compress_ratio=0.01, momentum=0.9, warmup_epochs=0)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters(), compression=dgc)
gen = torch.Generator().manual_seed(100 + rank)          # different data on each host
for _ in range(5):
    xb, yb = torch.randn(32, 256, generator=gen), torch.randint(0, 10, (32,), generator=gen)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(xb), yb).backward()
    opt.step()
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
gathered = hvd.allgather(flat.unsqueeze(0), name="cluster.params")
identical = bool(all(torch.equal(gathered[0], gathered[i]) for i in range(size)))
st = dgc.total_stats
if rank == 0:
    with open(args.out, "w") as f:
        json.dump({"hosts": hosts, "size": size, "allreduce_ok": allreduce_ok,
                   "dgc_identical": identical, "dgc_steps": st.steps, "dgc_selected": st.selected,
                   "dgc_wire_bytes": st.wire_bytes, "dgc_dense_bytes": st.dense_bytes,
                   "gloo_iface": os.environ.get("HOROVOD_GLOO_IFACE")}, f)
