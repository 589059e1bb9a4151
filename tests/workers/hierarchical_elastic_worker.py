"""Runs under elastic `horovodrun --gloo` with DGC(exchange="hierarchical"): the nodes change.

tests/test_elastic.py starts it as

    horovodrun -np 4 --min-np 2 --max-np 4 --host-discovery-script <script> --gloo \
        python tests/workers/hierarchical_elastic_worker.py --plan PLAN --out DIR --hosts-file F

with a discovery script that prints F: `localhost:2` and `127.0.0.1:2` at the start, two nodes of
two ranks as Horovod places them (by host name). Rank 0 rewrites F between steps:

* ``rejoin``: at step LEAVE it removes 127.0.0.1 (one node of two ranks: M 2 → 1, L stays 2), at
  step BACK it lists it again (Horovod starts two new workers there: 2 × 2 again);
* ``slots``: at step LEAVE it lists one slot per host (two nodes of one rank: L 2 → 1, so every
  shard is a whole tensor), at step BACK two again (2 × 2);
* ``unequal``: at step LEAVE it lists `127.0.0.1:1` (Horovod makes a world of 3 ranks, nodes of 2
  and 1): DGC must refuse the layout at the first step of the new world on every rank;
* ``exit``: the worker on 127.0.0.1 of local rank 1 calls os._exit(3) at step LEAVE (Horovod
  0.28.1 does not survive that with process sets besides the global one: every process aborts).

``--exchange allgather`` runs the same job with flat DGC (no shard checks), ``--process-set``
adds one process set of Horovod's at each entry (to tell Horovod's limit from DGC's).

Every process that ends (Python exits, not aborts) writes DIR/<host>.<pid>.json:

* restore: at step RESTORE one step not committed, state.restore(), DGC's state and the
  parameters compared with the commit (see :func:`restore_check`);

* entries: at each entry into the training function, world size, rank, Horovod's local and
  cross sizes, DGC's resets, and how many DGC states hold a nonzero velocity or residual;
* fresh: after the first step of each world, the layout DGC used (``dgc._hier.layout``) and,
  for every sharded tensor, whether this rank's state is that of a first step from zero on its
  shard of the new layout: u and v of |S_j| elements (S_j: ``shard_bounds`` of the new local
  size), u = v = G_c|S_j off the sent positions and 0 on them, G_c the node's average of the
  local gradients of the ranks of this rank's node (allgathered, float64). A state carried over
  from the previous world (u = m·u_old + G) fails it;
* final: the parameters finite and bit-identical on every rank of the last world;
* error: what the training function raised (``unequal``), its type, the step and world size.
"""
import argparse
import json
import os

import horovod.torch as hvd
import torch
import torch.nn.functional as F

from dgc_horovod.core.hierarchical import shard_bounds
from dgc_horovod.torch import DGC
from elastic_common import update_hosts

STEPS, RESTORE, LEAVE, BACK = 12, 2, 4, 8
MOMENTUM = 0.9
KW = dict(exchange="hierarchical", compress_ratio=0.05, momentum=MOMENTUM, warmup_epochs=0,
          min_sparse_numel=16)

# plan: (the hosts from step LEAVE, the hosts from step BACK or None)
BOTH = ["localhost:2", "127.0.0.1:2"]
PLANS = {"rejoin": (["localhost:2"], BOTH), "slots": (["localhost:1", "127.0.0.1:1"], BOTH),
         "unequal": (["localhost:2", "127.0.0.1:1"], None), "exit": (None, None)}

ap = argparse.ArgumentParser()
ap.add_argument("--plan", choices=sorted(PLANS), required=True)
ap.add_argument("--out", required=True)
ap.add_argument("--hosts-file", required=True)
ap.add_argument("--exchange", default="hierarchical", help="allgather: the same job with flat DGC")
ap.add_argument("--process-set", action="store_true",
                help="register one more process set (ranks 0 and 1) at each entry: with flat "
                "DGC, whether a crash is survived with a process set other than the global one")
args = ap.parse_args()

hvd.init(process_sets="dynamic")        # sets HOROVOD_DYNAMIC_PROCESS_SETS=1: every re-init too
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
dgc = DGC(**dict(KW, exchange=args.exchange))
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2),
                               named_parameters=model.named_parameters(), compression=dgc)
state = hvd.elastic.TorchState(model=model, optimizer=opt, dgc=dgc, step=0)
host = os.environ.get("HOROVOD_HOSTNAME", "localhost")
record = {"host": host, "entries": [], "fresh": []}


def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(32, 20, generator=g), torch.randint(0, 8, (32,), generator=g)


def train_step(step):
    """One step; returns this rank's local gradients before the exchange, {name: flat}."""
    x, y = batch(step, hvd.rank())
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    local = {n: p.grad.detach().reshape(-1).clone() for n, p in model.named_parameters()}
    opt.step()
    return local


def check_fresh(local):
    """The first step of a world: see the module docstring."""
    lay = dgc._hier.layout
    rows = hvd.allgather(torch.tensor([[hvd.rank(), hvd.cross_rank()]]),
                         name="check.layout").tolist()
    mine = [r for r, c in rows if c == hvd.cross_rank()]
    out = {"layout": lay.to_dict(), "node": mine, "tensors": {}}
    for name, st in sorted(dgc.states.items()):
        if not st.sparse:
            continue
        every = hvd.allgather(local[name].double().unsqueeze(0), name="check." + name)
        G = every[mine].mean(0)
        lo, hi = shard_bounds(G.numel(), lay.local_size)[lay.shard]
        u, v = st.u.double().reshape(-1), st.v.double().reshape(-1)
        kept = v != 0
        shard = G[lo:hi]
        out["tensors"][name] = {
            "numel": u.numel(), "expected_numel": hi - lo,
            "u_equals_v": bool(torch.equal(u, v)),
            "kept_is_G": u.numel() == hi - lo and bool(torch.allclose(
                v[kept], shard[kept], rtol=1e-5, atol=1e-7)),
            "sent": int((~kept & (shard != 0)).sum()) if u.numel() == hi - lo else -1}
    return out


def restore_check(step):
    """One step not committed, then state.restore(): DGC's state (this rank's shards) and the
    parameters back to the commit bit for bit; the next step makes the layout again from the
    process sets Horovod already has (the same session)."""
    committed = dgc.state_dict()
    params = [p.detach().clone() for p in model.parameters()]
    train_step(step)
    moved = any(not torch.equal(a, p) for a, p in zip(params, model.parameters()))
    state.restore()
    now = dgc.state_dict()
    same = all(torch.equal(a, p) for a, p in zip(params, model.parameters()))
    same = same and set(committed["tensors"]) == set(now["tensors"]) and all(
        (a is None and b is None) or torch.equal(a, b)
        for name, t in committed["tensors"].items()
        for a, b in ((t["u"], now["tensors"][name]["u"]), (t["v"], now["tensors"][name]["v"])))
    same = same and all(committed[k] == now[k] for k in ("epoch", "steps", "layout"))
    return {"moved": moved, "identical_to_commit": same, "layout_dropped": dgc._hier.layout is None,
            "step_after": state.step}


def nonzero_states():
    return sum(1 for st in dgc.states.values()
               if st.u.any() or (st.v is not None and st.v.any()))


@hvd.elastic.run
def train(state):
    if args.process_set:
        hvd.add_process_set([0, 1])
    record["entries"].append({
        "size": hvd.size(), "rank": hvd.rank(), "step": state.step,
        "local_size": hvd.local_size(), "cross_size": hvd.cross_size(),
        "resets": dgc.resets, "nonzero_states": nonzero_states()})
    print(f"entry on {host}: world size {hvd.size()}, rank {hvd.rank()}, step {state.step}",
          flush=True)
    first = True
    while state.step < STEPS:
        if state.step == RESTORE and "restore" not in record and args.exchange == "hierarchical":
            record["restore"] = restore_check(state.step)
        leave, back = PLANS[args.plan]
        if state.step == LEAVE and args.plan == "exit" and host == "127.0.0.1" \
                and hvd.local_rank() == 1:
            print(f"worker on {host} leaves at step {state.step}", flush=True)
            os._exit(3)
        if state.step == LEAVE and hvd.size() == 4 and leave:
            update_hosts(hvd, state, args.hosts_file, leave, f"hosts now {','.join(leave)}")
        if state.step == BACK and hvd.size() == 2 and back:
            update_hosts(hvd, state, args.hosts_file, back, f"hosts now {','.join(back)}")
        try:
            local = train_step(state.step)
        except Exception as e:
            record["error"] = {"step": state.step, "size": hvd.size(), "message": str(e),
                               "type": type(e).__name__}
            raise
        if first and args.exchange == "hierarchical":
            record["fresh"].append(check_fresh(local))
            first = False
        state.step += 1
        state.commit()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = hvd.allgather(flat.unsqueeze(0), name="final")
    record["final"] = {"size": hvd.size(), "rank": hvd.rank(), "resets": dgc.resets,
                       "finite": bool(torch.isfinite(flat).all()),
                       "identical": all(torch.equal(every[0], r) for r in every),
                       "norm": float(flat.double().norm())}


def write():
    with open(os.path.join(args.out, f"{host}.{os.getpid()}.json"), "w") as f:
        json.dump(record, f)


try:
    train(state)
finally:
    write()
print(f"finished on {host}: world size {hvd.size()}, DGC resets {dgc.resets}", flush=True)
