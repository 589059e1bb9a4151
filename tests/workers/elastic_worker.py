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
"""
import argparse
import json
import os
import time

import horovod.torch as hvd
import numpy as np
import torch
import torch.nn.functional as F
from horovod.common.exceptions import HorovodInternalError

from dgc_horovod.torch import DGC

STEPS, EXIT_STEP, RESTORE_STEP = 10, 6, 3
CLIP = 1e-3
# per-tensor clipping keeps the exchange overlapping with backward, so a failing step has
# compressed (and must be restored) before its collectives fail
DGC_KW = dict(compress_ratio=0.05, momentum=0.9, warmup_epochs=0, clip_norm=CLIP,
              clip_scope="tensor", min_sparse_numel=16, min_sparse_ndim=1, bucket_numel=600)

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--mode", choices=["exit", "remove"], default="exit")
parser.add_argument("--hosts-file", help="--mode remove: the file the discovery script prints")
args = parser.parse_args()

hvd.init()
HOST = os.environ.get("HOROVOD_HOSTNAME", "localhost")
LOCAL = int(os.environ.get("HOROVOD_LOCAL_RANK", "0"))
LEAVER = HOST == "127.0.0.1"

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
dgc = DGC(**DGC_KW)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                               named_parameters=model.named_parameters(), compression=dgc)
state = hvd.elastic.TorchState(model=model, optimizer=opt, dgc=dgc, step=0, worlds=0)
record = {"host": HOST, "local_rank": LOCAL, "entries": [], "fresh": [], "restore": None,
          "reset_callbacks": []}
committed_stat_steps = [0]


def on_reset():
    print(f"elastic reset: world size {hvd.size()}, rank {hvd.rank()}, host {HOST}", flush=True)
    record["reset_callbacks"].append(hvd.size())


state.register_reset_callbacks([on_reset])


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


def check_fresh(local, world, previous_world):
    """u = v = s·g off the sent positions, 0 on them; s from `world` (see module docstring)."""
    out = {"world": world, "tensors": 0, "ok": True, "fits_previous_world": False, "sent": 0}
    for name, st in sorted(dgc.states.items()):
        g = local[name]
        u = st.u.double().numpy()
        if st.sparse:
            v = st.v.double().numpy()
            if not np.array_equal(u, v):
                out["ok"] = False
            kept = v != 0
            out["sent"] += int((~kept & (g != 0)).sum())
        else:
            v, kept = u, np.ones_like(u, dtype=bool)        # dense: u = s·g, nothing cleared

        def fits(n):        # local clipping under op=Average: ||g|| <= CLIP * sqrt(N)
            s = min(1.0, CLIP * n ** 0.5 / (np.linalg.norm(g) + 1e-6))
            return bool(np.allclose(v[kept], s * g[kept], rtol=1e-5, atol=1e-12))

        out["tensors"] += 1
        out["ok"] = out["ok"] and fits(world)
        if previous_world and fits(previous_world):
            out["fits_previous_world"] = True
    return out


def remove_host(state):
    """Rank 0 drops 127.0.0.1 from the discovery output and waits for the driver's notice; the
    commit then raises HostsUpdatedInterrupt on every rank alike (it broadcasts rank 0's view)."""
    if hvd.rank() == 0:
        with open(args.hosts_file, "w") as f:
            f.write("localhost:2\n")
        print(f"host 127.0.0.1 removed from discovery at step {state.step}", flush=True)
        deadline = time.time() + 60
        while state._host_messages.empty():
            if time.time() > deadline:
                raise TimeoutError("no host update notice from the elastic driver in 60 s")
            time.sleep(0.1)
    state.commit()                                    # raises HostsUpdatedInterrupt


@hvd.elastic.run
def train(state):
    state.worlds += 1
    record["entries"].append({
        "size": hvd.size(), "rank": hvd.rank(), "step": state.step, "resets": dgc.resets,
        "dgc_states": len(dgc.states), "stat_steps": dgc.total_stats.steps,
        "committed_stat_steps": committed_stat_steps[0]})
    first_in_world = True                 # every entry starts a world (the start or a reset)
    previous = record["entries"][-2]["size"] if len(record["entries"]) > 1 else None
    while state.step < STEPS:
        step = state.step
        if LEAVER and step == EXIT_STEP and args.mode == "exit":
            print(f"worker on {HOST} leaves at step {step}", flush=True)
            os._exit(3)
        if step == EXIT_STEP and args.mode == "remove" and hvd.size() == 3:
            remove_host(state)
        if step == RESTORE_STEP and record["restore"] is None:
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
                committed[k] == now[k] for k in ("epoch", "total_stats", "step_stats"))
            same = same and torch.equal(committed["generator"], now["generator"])
            record["restore"] = {"moved": moved, "identical_to_commit": same,
                                 "step_after": state.step}
        try:
            local = train_step(step)
        except HorovodInternalError:
            record["failed"] = {"step": step, "stat_steps": dgc.total_stats.steps,
                                "committed_stat_steps": committed_stat_steps[0]}
            raise
        if first_in_world:
            record["fresh"].append(check_fresh(local, hvd.size(), previous))
            first_in_world = False
        state.step += 1
        state.commit()
        committed_stat_steps[0] = dgc.total_stats.steps
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = hvd.allgather(flat.unsqueeze(0), name="elastic.final")
    record["final"] = {"size": hvd.size(), "rank": hvd.rank(), "resets": dgc.resets,
                       "finite": bool(torch.isfinite(flat).all()),
                       "identical": all(torch.equal(every[0], r) for r in every),
                       "params": flat.tolist()}


# A DGC whose config differs on one rank: TorchState.sync refuses it on every rank.
other = DGC(**dict(DGC_KW, compress_ratio=0.1 if hvd.rank() == 1 else 0.05))
try:
    hvd.elastic.TorchState(dgc=other).sync()
    record["config_mismatch"] = None
except ValueError as e:
    record["config_mismatch"] = str(e)
del other

train(state)
with open(os.path.join(args.out, f"{HOST}.{LOCAL}.json"), "w") as f:
    json.dump(record, f)
print(f"finished on {HOST}: world size {hvd.size()}, DGC resets {dgc.resets}", flush=True)
