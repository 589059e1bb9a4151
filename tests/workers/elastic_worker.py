"""Runs under elastic `horovodrun` (Gloo): DGC with hvd.elastic.run / TorchState; a worker leaves.

tests/test_elastic.py starts it as

    horovodrun -np 3 --min-np 2 --max-np 3 --host-discovery-script <script> --gloo \
        python tests/workers/elastic_worker.py --out DIR

with a discovery script that lists `localhost:2` and `127.0.0.1:1` (two names of this machine, so
that Horovod blacklists only the failed worker's "host"). The worker on 127.0.0.1 calls
os._exit(3) at the start of step EXIT_STEP; the two others then fail in a collective
(HorovodInternalError), restore the last commit, re-initialize Horovod with 2 ranks and finish.

What every process records (DIR/<host>.<local rank>.json, written when it finishes):

* restore: at step RESTORE_STEP it trains one step without committing, calls state.restore()
  and compares DGC's state_dict and the parameters with the committed ones (torch.equal).
* fresh: at the first step of every world (start, and after the reset) the DGC state was empty
  before the step, so afterwards every tensor must hold exactly u = v = s·g outside the sent
  positions and 0 at them (momentum correction from zero, momentum factor masking), with g the
  local gradient and s the local clipping factor min(1, clip·N^(1/2) / (|g| + 1e-6)) (op=Average) of the
  current world size N (NumPy transcription of §3.1–3.2). It also records whether the values
  would fit the previous N instead (they must not: the clipping follows the new N).
* failed: the step whose collective failed, with DGC's total step count then (the failed step
  already counted) and at the last commit.
* entries: at each entry into the training function: world size, rank, DGC resets so far, the
  number of DGC tensor states, and DGC's total step count against the one at the last commit.
* config_mismatch: the error of TorchState(dgc=DGC(...)).sync() when rank 1's DGC has another
  compress_ratio (before training, on every rank).
* final: the parameters (flattened) as a list, whether they are finite, and whether they are
  bit-identical on every rank of the final world (one allgather).

The loop and the records are elastic_common.py's, shared with tf_elastic_worker.py.
"""
import horovod.torch as hvd
import torch
import torch.nn.functional as F
from horovod.common.exceptions import HorovodInternalError

from dgc_horovod.torch import DGC
from elastic_common import DGC_KW, parse_args, run

args = parse_args()
hvd.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
dgc = DGC(**DGC_KW)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                               named_parameters=model.named_parameters(), compression=dgc)
state = hvd.elastic.TorchState(model=model, optimizer=opt, dgc=dgc, step=0)


def batch(step):
    g = torch.Generator().manual_seed(1000 * step + hvd.rank())
    return torch.randn(32, 20, generator=g), torch.randint(0, 4, (32,), generator=g)


def train_step(step):
    """One step; returns this rank's local gradients (before the exchange) by name."""
    x, y = batch(step)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    local = {n: p.grad.detach().double().numpy().ravel().copy()
             for n, p in model.named_parameters()}
    opt.step()
    return local


def dgc_arrays():
    return {name: (st.sparse, st.u.double().numpy(),
                   st.v.double().numpy() if st.sparse else None)
            for name, st in dgc.states.items()}


def restore_check(step):
    committed = dgc.state_dict()
    params = [p.detach().clone() for p in model.parameters()]
    train_step(step)                      # not committed
    moved = any(not torch.equal(a, p) for a, p in zip(params, model.parameters()))
    state.restore()
    now = dgc.state_dict()
    same = all(torch.equal(a, p) for a, p in zip(params, model.parameters()))
    for name, t in committed["tensors"].items():
        for key in ("u", "v"):
            a, b = t[key], now["tensors"][name][key]
            same = same and ((a is None and b is None) or torch.equal(a, b))
    same = same and set(committed["tensors"]) == set(now["tensors"]) and all(
        committed[k] == now[k] for k in ("epoch", "steps", "total_stats", "step_stats"))
    return {"moved": moved, "identical_to_commit": same, "step_after": state.step}


def final_params():
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = hvd.allgather(flat.unsqueeze(0), name="elastic.final")
    return (flat.tolist(), bool(torch.isfinite(flat).all()),
            all(torch.equal(every[0], r) for r in every))


run(hvd, args, state, dgc, train_step, restore_check, dgc_arrays, final_params,
    HorovodInternalError, lambda other: hvd.elastic.TorchState(dgc=other))
